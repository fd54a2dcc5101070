# The dcp-gateway service image (compose.yaml builds it): engine + gateway + HTTP API, and the search
# indexer (`dcpgw index`, with the Elasticsearch client for --backend elasticsearch).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY engine ./engine
COPY gateway ./gateway
COPY connectors ./connectors
COPY bench ./bench
COPY schemas ./schemas
# gcc for the install only: it compiles the engine's ingest path (setup.py, docs/performance.md "Compiled modules")
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install '.[elasticsearch]' \
    && apt-get purge -y --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 dcpgw && mkdir /data && chown dcpgw /data

USER dcpgw
# the container's API port (the product's own default is 8091, docs/configuration.md)
ENV DCPGW_HTTP_PORT=8080
EXPOSE 8080
VOLUME /data
CMD ["dcpgw", "up", "--no-progress"]
