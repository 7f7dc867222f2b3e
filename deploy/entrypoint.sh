#!/bin/sh
# Container entrypoint for the Ceaseless image: turn the NATS password from the environment
# into the credentials file the services (--creds / CEASELESS_CREDS) and the agent
# (CEASELESS_CREDS) read, then exec the command.
#
#   CEASELESS_CREDS           an existing JSON file {"user": ..., "password": ...}: used as is
#   CEASELESS_NATS_USER       default "ceaseless"
#   CEASELESS_NATS_PASSWORD   written to a 0600 file in $TMPDIR and removed from the env
#   CEASELESS_POD_SUFFIX=random   append a random suffix to the pod id (HOSTNAME), so a
#                             restarted container never reuses its pod id (fencing is by id)
set -eu

if [ -z "${CEASELESS_CREDS:-}" ] && [ -n "${CEASELESS_NATS_PASSWORD:-}" ]; then
  CEASELESS_CREDS="$(mktemp "${TMPDIR:-/tmp}/ceaseless-creds.XXXXXX")"
  chmod 600 "$CEASELESS_CREDS"
  python - "$CEASELESS_CREDS" <<'PY'
import json, os, sys
with open(sys.argv[1], "w") as f:
    json.dump({"user": os.environ.get("CEASELESS_NATS_USER", "ceaseless"),
               "password": os.environ["CEASELESS_NATS_PASSWORD"]}, f)
PY
  export CEASELESS_CREDS
fi
unset CEASELESS_NATS_PASSWORD

if [ -z "${CEASELESS_POD:-}" ] && [ "${CEASELESS_POD_SUFFIX:-}" = "random" ]; then
  CEASELESS_POD="${HOSTNAME:-pod}-$(python -c 'import secrets; print(secrets.token_hex(3))')"
  export CEASELESS_POD
fi

exec "$@"
