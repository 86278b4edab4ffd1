# A rollout node: docker build -t patchswarm-node . && docker run -v $PWD/etc:/etc/patchswarm \
#   -v patchswarm-store:/var/lib/patchswarm -p 7400:7400 patchswarm-node
# GPU hosts: build FROM a CUDA base with the CUDA torch wheel installed first instead.
# For a CPU-only image pass your CPU wheel index:
#   docker build --build-arg PIP_EXTRA_INDEX_URL=<your torch CPU wheel index> .
FROM python:3.11-slim
ARG PIP_EXTRA_INDEX_URL=""

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/patchswarm

COPY pyproject.toml constraints.txt README.md ./
COPY swarm ./swarm
COPY node ./node
COPY trainer ./trainer
COPY simulations ./simulations
COPY patchswarm ./patchswarm
# a C compiler for the build only: it compiles the codec's fused loops (swarm/codec/_dense.c;
# without one the install goes on with numpy's, about half as fast), then leaves the image
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install -c constraints.txt . \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/patchswarm --create-home patchswarm \
 && mkdir -p /etc/patchswarm && chown patchswarm /var/lib/patchswarm

USER patchswarm
EXPOSE 7400
VOLUME ["/var/lib/patchswarm"]
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7400/healthz', timeout=4)"
STOPSIGNAL SIGTERM
ENTRYPOINT ["patchswarm", "node"]
CMD ["--config", "/etc/patchswarm/node.toml"]
