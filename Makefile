# The two commands: `make demo` (a real replay of real dead letters, and its report) and `make test`.
export AMQP_URL ?= amqp://guest:guest@127.0.0.1:5672/%2f
export REDIS_URL ?= redis://127.0.0.1:6379/
CARGO ?= cargo

.PHONY: demo test lint services crd bench e2e faults fuzz

demo: services
	$(CARGO) build --release --quiet
	./target/release/dlq-replay demo -f examples/replay.yaml
	@echo "--- plan of what is left in demo.dlq (a dry run: changes nothing)"
	./target/release/dlq-replay plan -f examples/replay.yaml
	@echo "--- the replay's incident report (dlq-replay report; --format md for Markdown)"
	./target/release/dlq-replay report -f examples/replay.yaml -o demo-report.html
	@echo "open $(CURDIR)/demo-report.html"

# Then the engine, canary and fault suites once more with the Redis Cluster of .ci/redis-ha as
# the store (TEST_REDIS_URL): skipped, and said so, when it is not up, unless REQUIRE_CLUSTERS=1.
REDIS_CLUSTER_URL ?= redis+cluster://127.0.0.1:7100,127.0.0.1:7101,127.0.0.1:7102

test: services
	$(CARGO) test --workspace --all-targets -- --test-threads 4
	@if redis-cli -p 7100 cluster info 2>/dev/null | grep -q cluster_state:ok; then \
	  echo "--- the engine, canary and fault suites on a Redis Cluster ($(REDIS_CLUSTER_URL))"; \
	  TEST_REDIS_URL=$(REDIS_CLUSTER_URL) $(CARGO) test --test engine --test canary --test faults -- --test-threads 4; \
	elif [ "$$REQUIRE_CLUSTERS" = 1 ]; then \
	  echo "no Redis Cluster on 127.0.0.1:7100 (.ci/redis-ha up) and REQUIRE_CLUSTERS=1" >&2; exit 1; \
	else \
	  echo "skipped: the suites on a Redis Cluster (.ci/redis-ha up starts one)"; \
	fi

# The conformance suite and the controller lifecycles against a real cluster (E2E=1 and KUBECONFIG
# set; skipped, and said so, otherwise). The controller runs in-process against the local RabbitMQ
# and Redis. `../shared/kube/up` starts a real kube-apiserver and prints its KUBECONFIG; `.ci/run`
# does so and runs these in `make test` (REQUIRE_KUBE=1: skipping is a failure there).
e2e: services
	E2E=1 $(CARGO) test --test fake_api -- e2e --nocapture
	E2E=1 $(CARGO) test --test controller -- e2e --nocapture

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Throughput vs RabbitMQ's Shovel, rate accuracy and memory growth of the release binary
# (BENCH_N=50000 messages per run, BENCH_REPS=3, BENCH_MEM=0 skips the 100k memory run,
# BENCH_RUN_ARGS adds arguments to `dlq-replay run`, e.g. "--window 128"). Throughput runs per
# queue type and broker, each against its own Shovel: BENCH_QUEUES=classic,quorum (the default)
# on RabbitMQ 3.10; BENCH_BROKERS=3.10,4 (default: 3.10, plus the quorum rows on RabbitMQ 4 at
# AMQP4_URL, default 127.0.0.1:5673, when `.ci/rabbitmq4` has it up). Then the canary section:
# BENCH_CANARY_N=100000 messages drained with the canary off and on (BENCH_CANARY_REPS=2 each,
# BENCH_CANARY_WAIT=5 s) while BENCH_CANARY_ARRIVALS=20 unrelated dead letters a second arrive.
# BENCH_SECTIONS=throughput,rate,memory,canary picks the parts. Output: bench/RESULTS.md.
bench: services
	$(CARGO) build --release --quiet
	$(CARGO) run --release --quiet --example bench

# Every fault of the fault suite at full size (kill -9 at FAULT_KILLS=10 seeded points of a
# FAULT_N=20000-message drain in Check and Claim mode, cut connections, a 10 s broker stop_app,
# Redis paused and killed, the target exchange deleted, a full target queue, poison coming back),
# then the table: lost must be 0, keys twice 0 in Claim mode. FAULT_SEED repeats a run;
# FAULT_TARGET=quorum_4_x (or classic_3_10, the default, quorum_3_10, classic_4_x) picks the broker
# and queue type. Stops the broker for 10 s: run it when nothing else uses it.
faults: services
	$(CARGO) build --release --quiet
	$(CARGO) run --release --quiet --example faults

# The cargo-fuzz targets in fuzz/ (classify: the per-message rules on arbitrary headers, bodies
# and specs; key: the idempotency key), FUZZ_SECONDS in all, half each. Needs the nightly
# toolchain and `cargo install cargo-fuzz --locked`. A crash leaves its input in fuzz/artifacts/.
# One input taking over 10 s is a finding too. Not part of `make test`.
FUZZ_SECONDS ?= 60
FUZZ_ARGS = -max_total_time=$$(( $(FUZZ_SECONDS) / 2 )) -timeout=10 -print_final_stats=1
fuzz:
	cargo +nightly fuzz run classify -- $(FUZZ_ARGS)
	cargo +nightly fuzz run key -- $(FUZZ_ARGS)

crd:
	$(CARGO) run --quiet -- crd > crds/dlqreplay.yaml

# Make sure the local RabbitMQ and Redis answer; start them if they do not.
services:
	@.ci/services
