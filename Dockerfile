# askgui on an NVIDIA GPU: a CUDA 13.0 devel stage builds askgui-serve, askgui-train and askgui-eval with
# `--features cuda`; a slim CUDA runtime stage runs askgui-serve by default.
#
#   docker build -t askgui --build-arg CUDA_COMPUTE_CAP=90 .      # 80: A100, 89: L4/RTX 40, 90: H100/H200
#   docker run --gpus all -p 8000:8000 -v $PWD/models:/models askgui --model /models/qwen2.5-vl-3b
#   docker run --gpus all --entrypoint askgui-train askgui --help
#
# The kernels' PTX is compiled for CUDA_COMPUTE_CAP; the driver JIT-compiles it for newer GPUs. The host
# needs an NVIDIA driver for CUDA 13.0 (580 or newer) and the NVIDIA Container Toolkit for `--gpus`.

ARG CUDA_VERSION=13.0.2
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
ARG CUDA_COMPUTE_CAP=90
ARG RUST_VERSION=1.95.0
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl gcc g++ libc6-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
RUN curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain "${RUST_VERSION}"
# kernels/build.rs and candle's build scripts read CUDA_COMPUTE_CAP (there is no GPU to ask at build time).
ENV PATH=/root/.cargo/bin:/usr/local/cuda/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP} \
    CARGO_INCREMENTAL=0
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/root/.cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --features cuda -p askgui-serve -p askgui-train -p askgui-eval \
    && mkdir -p /out \
    && cp target/release/askgui-serve target/release/askgui-train target/release/askgui-eval /out/

# The runtime image has cuBLAS, cuRAND and NVRTC, which candle loads; the driver (libcuda) comes from the
# host through the NVIDIA Container Toolkit.
FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU}
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/ /usr/local/bin/
# Hub ids given to --model are downloaded into HF_HOME; mount a volume there to keep them.
ENV HF_HOME=/cache/huggingface \
    ASKGUI_SERVE_HOST=0.0.0.0 \
    ASKGUI_SERVE_PORT=8000 \
    ASKGUI_SERVE_DEVICE=auto
EXPOSE 8000
ENTRYPOINT ["askgui-serve"]
