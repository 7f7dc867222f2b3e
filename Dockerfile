# syntax=docker/dockerfile:1
# One image for the control-plane services and the trainers (compose.yaml builds it).
#   docker build -t ceaseless:dev .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, CPU build, from the PyTorch index (a large layer that rarely changes).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY agent ./agent
COPY services ./services
COPY examples ./examples
COPY bench ./bench
RUN pip install .

COPY deploy/entrypoint.sh /usr/local/bin/ceaseless-entrypoint
RUN chmod 0755 /usr/local/bin/ceaseless-entrypoint \
 && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin ceaseless \
 && mkdir -p /runs /data \
 && chown ceaseless:ceaseless /runs /data

# Never root at run time; /runs (traces, metrics) and /data are the writable places.
USER ceaseless
ENTRYPOINT ["ceaseless-entrypoint"]
CMD ["ceaseless", "--help"]
