# Prometheus from Debian's package (2.42, as in scripts/setup.sh), for
# machines without a registry. deploy/build-images.sh builds it as
# aqswarm-prometheus:latest on the aqswarm-base image; the Compose file's
# prometheus service runs it with deploy/prometheus.yml.
ARG DEBIAN_IMAGE=debian:bookworm-slim
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus curl ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
WORKDIR /prometheus
EXPOSE 9091
VOLUME ["/prometheus"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
