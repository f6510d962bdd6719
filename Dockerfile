# Build: the toolchain image compiles a release binary; the runtime image holds only it.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
COPY src src
RUN cargo build --release --locked --bin dlq-replay

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/dlq-replay /usr/local/bin/dlq-replay
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/dlq-replay"]
CMD ["operator"]
