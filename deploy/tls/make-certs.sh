#!/bin/sh
# TLS and basic auth for the exporter (--web.config.file), for docker-compose.tls.yml and
# the Kubernetes tls component: a CA, the exporter's certificate signed by it, a random
# scrape password, and the exporter's web config with that password's bcrypt hash.
#
#   deploy/tls/make-certs.sh [DIR]        # DIR defaults to this script's directory
#
# Needs openssl and a Python with bcrypt (the exporter's dependency), python3 by default:
#   PYTHON=.venv/bin/python deploy/tls/make-certs.sh
#   PYTHON="docker run --rm -i --entrypoint python dataloader-exporter:0.1.0" \
#     deploy/tls/make-certs.sh                                 # the exporter image's
#
# Writes, replacing any earlier set (restart the exporter and Prometheus after):
#   ca.crt               the CA's certificate, for Prometheus (and curl) to check with
#   tls.crt, tls.key     the exporter's certificate and key, for the names
#                        exporter (compose), dataloader-exporter (the PodMonitor's
#                        serverName), localhost and 127.0.0.1, and any in EXTRA_SANS
#                        (e.g. EXTRA_SANS=DNS:trainer-0.example.com,IP:10.0.0.7)
#   prometheus-password  the password of user "prometheus", for Prometheus's password_file
#   web-config.yml       tls.crt and tls.key (relative: beside it) and the bcrypt hash
# The CA's key is thrown away once it has signed: nothing else can be signed with it, and
# running the script again makes a new set. Certificates last DAYS days (default 825).
# The files are readable by all: the exporter (user 10001) and Prometheus (nobody) read
# them through bind mounts. They are git-ignored; never commit them.
set -eu

dir=${1:-$(dirname "$0")}
python=${PYTHON:-python3}
days=${DAYS:-825}
user=prometheus
sans="DNS:exporter,DNS:dataloader-exporter,DNS:localhost,IP:127.0.0.1${EXTRA_SANS:+,$EXTRA_SANS}"

command -v openssl >/dev/null 2>&1 || { echo "make-certs.sh: openssl not found" >&2; exit 1; }
# shellcheck disable=SC2086 # PYTHON may be a command with arguments
if ! $python -c 'import bcrypt' </dev/null >/dev/null 2>&1; then
    echo "make-certs.sh: '$python' has no bcrypt; set PYTHON (see the top of this script)" >&2
    exit 1
fi
mkdir -p "$dir"
work=$(mktemp -d "$dir/.make-certs.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'exit 1' INT TERM
umask 077

cat >"$work/openssl.cnf" <<EOF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical,CA:TRUE,pathlen:0
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = $sans
EOF

ssl() { openssl "$@" 2>"$work/openssl.log" || { cat "$work/openssl.log" >&2; exit 1; }; }
for name in ca tls; do
    ssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$work/$name.key"
done
ssl req -x509 -new -key "$work/ca.key" -out "$work/ca.crt" -days "$days" \
    -subj "/CN=dataloader-exporter CA" -config "$work/openssl.cnf" -extensions ca
ssl req -new -key "$work/tls.key" -out "$work/tls.csr" -subj "/CN=exporter" \
    -config "$work/openssl.cnf"
ssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" -out "$work/tls.crt" \
    -extfile "$work/openssl.cnf" -extensions server

# 32 random bytes in hex: 64 characters, under bcrypt's 72, no character YAML or a shell
# would mind; no newline, and read from stdin, never from an argument ps could show.
openssl rand -hex 32 | tr -d '\n' >"$work/prometheus-password"
# shellcheck disable=SC2086
hash=$($python -c 'import sys, bcrypt; sys.stdout.write(bcrypt.hashpw(sys.stdin.buffer.read(), bcrypt.gensalt()).decode())' <"$work/prometheus-password")
case $hash in
    '$2'?'$'*) ;;
    *) echo "make-certs.sh: '$python' gave no bcrypt hash" >&2; exit 1 ;;
esac
cat >"$work/web-config.yml" <<EOF
# Written by deploy/tls/make-certs.sh: the exporter's --web.config.file (exporter-toolkit's
# format). Paths are relative to this file.
tls_server_config:
  cert_file: tls.crt
  key_file: tls.key
basic_auth_users:
  $user: '$hash'
EOF

for f in ca.crt tls.crt tls.key prometheus-password web-config.yml; do
    chmod 0644 "$work/$f"
    mv -f "$work/$f" "$dir/$f"
done
echo "make-certs.sh: wrote ca.crt tls.crt tls.key prometheus-password web-config.yml to $dir"
