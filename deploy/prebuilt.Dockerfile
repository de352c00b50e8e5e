# The fast path to the aqswarm image: deploy/Dockerfile's runtime-base plus a
# binary built outside Docker on a Debian 12 machine (scripts/setup.sh), and
# the libraries it links that no Debian package provides (CUDA's runtime and
# NCCL, for a build with AQSWARM_WITH_CUDA). deploy/build-images.sh --prebuilt
# prepares the build context: ./aqswarm and ./lib/.
ARG RUNTIME_BASE=aqswarm-runtime-base:latest
FROM ${RUNTIME_BASE}
COPY lib/ /usr/local/lib/aqswarm/
COPY aqswarm /usr/local/bin/aqswarm
USER root
RUN echo /usr/local/lib/aqswarm > /etc/ld.so.conf.d/aqswarm.conf && ldconfig
USER aqswarm
RUN aqswarm version
