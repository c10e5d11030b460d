#!/usr/bin/env bash
# Least-privilege ACLs for a real Kafka cluster: one principal per role, from
# the table in tools/kafka_acls.py (the same one the local secure stack applies).
#
#   deploy/kafka/acls.sh BOOTSTRAP ADMIN_CLIENT_CONFIG [--dry-run] [--user ROLE=NAME ...]
#
# ADMIN_CLIENT_CONFIG: a client properties file of a principal allowed to alter
# ACLs (security.protocol, sasl.mechanism, sasl.jaas.config, ssl.truststore.*);
# keep it readable by its owner only. --user maps a role to the cluster's SCRAM
# user (defaults: payment-client=payments, scoring-worker=scoring,
# feedback-worker=feedback, analyst=analyst, gateway=gateway). Topic names and
# the app id come from the FRAUD_* environment, as for the workers.
# kafka-acls.sh (from the Kafka distribution) must be on PATH, or set KAFKA_ACLS.
# --dry-run prints the commands instead of running them. Adding an ACL that
# exists is a no-op: the script can be rerun after the table changes (it never
# removes ACLs; remove a revoked right with kafka-acls.sh --remove).
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '5,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
bootstrap=$1
config=$2
shift 2
dry_run=false
user_args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --dry-run) dry_run=true ;;
    --user) user_args+=(--user "$2"); shift ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
  shift
done

here=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
[[ -x $python ]] || python=python3
kafka_acls=${KAFKA_ACLS:-kafka-acls.sh}
if [[ $dry_run == false ]] && ! command -v "$kafka_acls" >/dev/null; then
  echo "kafka-acls.sh not found: put the Kafka distribution's bin/ on PATH or set KAFKA_ACLS" >&2
  exit 1
fi
if [[ $dry_run == false && ! -r $config ]]; then
  echo "cannot read the admin client config $config" >&2
  exit 1
fi

lines=$(cd "$here" && "$python" -m tools.kafka_acls "${user_args[@]}")
while IFS= read -r line; do
  [[ -z $line ]] && continue
  eval "args=($line)"
  if [[ $dry_run == true ]]; then
    printf '%s --bootstrap-server %q --command-config %q %s\n' "$kafka_acls" "$bootstrap" "$config" "$line"
  else
    "$kafka_acls" --bootstrap-server "$bootstrap" --command-config "$config" "${args[@]}"
  fi
done <<<"$lines"
