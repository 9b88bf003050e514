# A kvroute worker (CPU torch). Build from the repository root:
#   docker build -f deploy/worker.Dockerfile -t kvroute-worker .
# It listens on every interface of its container; give it --advertise-host (the name other
# machines reach it at) so that what it registers can be dialled. tests/deploy checks this file.

FROM python:3.12-slim AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY events/ events/
COPY pool/ pool/
COPY router/ router/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.12-slim
# CPU torch first, from PyTorch's CPU index, at a version the worker extra accepts; the
# install below then keeps it instead of pulling a CUDA build.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/kvroute-*.whl)[worker,tokenizers,chat]" \
    && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home kvroute
USER 10001
# HTTP API, KV event PUB socket, replay ROUTER socket.
EXPOSE 8100 5557 5558
ENTRYPOINT ["kvroute"]
CMD ["worker", "--host", "0.0.0.0", "--port", "8100", "--events", "tcp://0.0.0.0:5557", "--replay", "tcp://0.0.0.0:5558"]
