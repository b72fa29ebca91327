# The exporter sidecar: no torch, a venv, a non-root user.
#   docker build -t dataloader-exporter .
#   docker run --rm -p 9478:9478 -v metrics:/run/dataloader-exporter \
#     --ipc=container:<trainer> dataloader-exporter
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
WORKDIR /src
# The build context is the checkout less .dockerignore's entries: setup.py finds the
# packages, so no list of folders here has to follow the tree.
COPY . .
# The base install only: prometheus_client, nvidia-ml-py, psutil, PyYAML, bcrypt (no torch).
# This image has no C compiler, so the per-batch path's optional C extension is skipped:
# the sidecar never runs it (docker/trainer.Dockerfile builds it).
RUN /opt/venv/bin/pip install .

FROM python:3.11-slim
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    DATALOADER_EXPORTER_DIR=/run/dataloader-exporter \
    NVIDIA_DRIVER_CAPABILITIES=utility
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin exporter \
    && mkdir -p /run/dataloader-exporter
USER 10001
EXPOSE 9478
# /-/healthy over plain HTTP; with a --web.config.file (TLS, basic auth) in the variable,
# only that the port accepts connections (the compose override checks /-/healthy itself).
HEALTHCHECK --interval=15s --timeout=3s --start-period=5s \
    CMD ["python", "-c", "import os, socket, urllib.request as u; socket.create_connection(('127.0.0.1', 9478), 2).close() if os.environ.get('DATALOADER_EXPORTER_WEB_CONFIG_FILE') else u.urlopen('http://127.0.0.1:9478/-/healthy', timeout=2)"]
ENTRYPOINT ["dataloader-exporter", "serve"]
