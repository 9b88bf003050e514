# The kvroute router. Build from the repository root:
#   docker build -f deploy/router.Dockerfile -t kvroute-router .
# Run it with a Redis URL (KVROUTE_REDIS_URL or --redis): the image has no redis-server,
# so the router never falls back to an embedded one. tests/deploy checks this file.

# The wheel is built where a C compiler is (the ingest's optional C extensions).
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
COPY --from=build /wheels /wheels
# tokenizers and chat: --tokenizer and chat templates of real models.
RUN pip install --no-cache-dir "$(ls /wheels/kvroute-*.whl)[tokenizers,chat]" \
    && rm -rf /wheels \
    && useradd --system --uid 10001 --no-create-home kvroute
USER 10001
EXPOSE 8000
ENTRYPOINT ["kvroute"]
CMD ["router", "--host", "0.0.0.0", "--port", "8000"]
