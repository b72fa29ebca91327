# The example trainer for docker-compose: torch (CPU build by default), the instrumented
# DataLoader, and examples/train.py, writing snapshots for the sidecar.
FROM python:3.11-slim AS build
ARG TORCH_VERSION=2.13.0
# The CPU wheel index keeps the image small; point it at a CUDA index for GPU images.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# gcc builds the per-batch path's C extension (instrument/hotpath/_hotpath.c); the final stage
# takes only the venv.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && /opt/venv/bin/pip install numpy
WORKDIR /src
# The checkout less .dockerignore's entries; setup.py finds the packages.
COPY . .
RUN /opt/venv/bin/pip install ".[torch]"

FROM python:3.11-slim
COPY --from=build /opt/venv /opt/venv
COPY examples /app/examples
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    DATALOADER_EXPORTER_DIR=/run/dataloader-exporter
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin trainer \
    && mkdir -p /run/dataloader-exporter && chown 10001 /run/dataloader-exporter
USER 10001
WORKDIR /app
ENTRYPOINT ["python", "/app/examples/train.py"]
CMD ["--epochs", "0", "--workers", "2"]
