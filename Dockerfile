# syntax=docker/dockerfile:1
# One image for the control-plane services and the trainers (compose.yaml builds it).
#   docker build -t ceaseless:dev .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the PyTorch index (a large layer that rarely changes). CPU build by
# default; the CUDA variant for GPU trainers takes the index of your CUDA version:
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 -t ceaseless:cuda .
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}

WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY agent ./agent
COPY plumbing ./plumbing
COPY services ./services
COPY ops ./ops
COPY examples ./examples
COPY bench ./bench
# extras, e.g. --build-arg EXTRAS='[ray]' for `ceaseless up --actuator ray` (docs/cluster.md)
ARG EXTRAS=""
RUN pip install ".${EXTRAS}"

COPY deploy/entrypoint.sh /usr/local/bin/ceaseless-entrypoint
RUN chmod 0755 /usr/local/bin/ceaseless-entrypoint \
 && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin ceaseless \
 && mkdir -p /runs /data \
 && chown ceaseless:ceaseless /runs /data

# Never root at run time; /runs (traces, metrics) and /data are the writable places.
USER ceaseless
ENTRYPOINT ["ceaseless-entrypoint"]
CMD ["ceaseless", "--help"]
