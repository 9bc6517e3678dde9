# idem: `just prove` runs the day, `just test` the suite a newcomer runs,
# `just long` the long proofs, `just ci` everything CI runs.

# The day: writes out/{idem.db,dup_report.json,day.db,result.json,policy.json,idem_report.md}
prove out="out":
    cargo run --release --bin idem -- prove --out {{out}}

# The suite (scenarios, properties, races, loom, one pass of the checker's
# cohort, one chaos day, one failover), then lint: minutes, not a quarter hour.
test:
    cargo test --release
    cargo fmt --check
    cargo clippy --all-targets -- -D warnings
    tools/house --check
    RUSTDOCFLAGS="-D warnings" cargo doc --no-deps

# The long proofs, which CI runs too: the whole checker cohort (every
# profile, choice and mutant on every property), the failover and fault
# mixes of a replicated cluster, the payouts' chaos day on PostgreSQL.
long:
    cargo test --release -- --ignored

# The deep property storm: tens of thousands of random days.
storm cases="20000":
    PROPTEST_CASES={{cases}} cargo test --release --test engine storm::

# The long kill test: 3000 idem_api processes killed with SIGKILL at random moments.
kill runs="3000":
    IDEM_KILL_RUNS={{runs}} cargo test --release --test engine kill:: -- --nocapture

# Run each deliberately broken engine (tests/engine/models/broken.rs) and show what catches it.
teeth:
    cargo test --release --test engine teeth:: -- --nocapture

# The service under load: SQLite at 1, 8, 64, 256 connections, the limits, growth.
bench-serve:
    cargo bench --bench serve

# The floor under a request at 64 connections: a bare hyper server, idem
# refusing before its store, idem paying, alternating; server CPU per request.
bench-floor:
    IDEM_BENCH_FLOOR=1 cargo bench --bench serve

# Latency at a fixed arrival rate (25-110 % of the saturation), on SQLite; the plot in target/arrival.svg.
bench-arrival:
    cargo bench --bench arrival

# Latency at a fixed arrival rate on PostgreSQL across a 1 ms round trip; then on
# tools/pg-ha's synchronous three-node cluster against one node, in the same run.
bench-arrival-pg:
    #!/usr/bin/env bash
    set -euo pipefail
    base=$(tools/pg-local start)
    IDEM_BENCH_PG="$base" cargo bench --bench arrival
    ha=$(tools/pg-ha start)
    tools/pg-ha wait-settled 120 >/dev/null
    IDEM_BENCH_PG="$base" IDEM_BENCH_HA="$ha" cargo bench --bench arrival

# The same on PostgreSQL too (a local cluster, an empty database), beside pgbench.
bench-serve-pg:
    #!/usr/bin/env bash
    set -euo pipefail
    base=$(tools/pg-local start)
    psql "$base" -qc "DROP DATABASE IF EXISTS idem_bench" -c "CREATE DATABASE idem_bench"
    IDEM_BENCH_PG="${base/dbname=postgres/dbname=idem_bench}" cargo bench --bench serve

# The library's layer on PostgreSQL under 64 connections (sqlx and deadpool-postgres
# pools of 10), against a bare handler doing the same writes, in one run.
bench-layer-pg:
    #!/usr/bin/env bash
    set -euo pipefail
    base=$(tools/pg-local start)
    psql "$base" -qc "DROP DATABASE IF EXISTS idem_layer" -c "CREATE DATABASE idem_layer"
    IDEM_BENCH_PG="${base/dbname=postgres/dbname=idem_layer}" cargo bench --bench layer_pg

# idem serve on PostgreSQL across a delayed hop (0, 0.5, 1, 2 ms round trip), beside
# the one-round-trip limit (pgbench calling one function). IDEM_BENCH_SECONDS=8 for the documented run.
bench-network:
    #!/usr/bin/env bash
    set -euo pipefail
    base=$(tools/pg-local start)
    psql "$base" -qc "DROP DATABASE IF EXISTS idem_network" -c "CREATE DATABASE idem_network"
    IDEM_BENCH_PG="${base/dbname=postgres/dbname=idem_network}" cargo bench --bench network

# cargo-mutants, installed on first use (a fresh machine has none).
_cargo-mutants:
    @command -v cargo-mutants >/dev/null 2>&1 || cargo install --locked cargo-mutants

# Mutation testing (slow: about an hour each). Settings in .cargo/mutants.toml.
mutants: _cargo-mutants
    IDEM_BACKENDS=sqlite cargo mutants

# The PostgreSQL store's mutants, against the suites on PostgreSQL.
mutants-pg: _cargo-mutants
    IDEM_BACKENDS=postgres,serializable cargo mutants --no-config --profile mutants --timeout-multiplier 3 \
        --file 'src/store/pg/*.rs' --cargo-test-arg=--test=engine

# Benchmarks: medians and ratios against the Python peer and the disk's fsync rate.
bench:
    cargo bench --bench idem

# A long chaos day: many clients, a lossy network, the server killed mid-day (see chaos_report.md).
chaos clients="32" transfers="200" kills="5":
    cargo run --release --bin idem -- chaos --out out/chaos --clients {{clients}} --transfers {{transfers}} --kills {{kills}}

# A local PostgreSQL for trying idem: prints the --db connection string. `just pg stop` stops it.
pg action="start":
    tools/pg-local {{action}}

# cargo deny check (deny.toml): advisories, licences, bans, sources.
deny:
    tools/deny

# What CI runs, from this checkout.
ci:
    bash .ci/run

# A primary paused (SIGSTOP) past its leader TTL while idem serve runs: the
# service must move to the new primary and lose nothing acknowledged. In the
# suite; this runs it N times, for its failure rate (0 of 10 on the v2 API,
# 3 of 5 on v3: see tools/pg-ha).
failover-pause runs="3":
    #!/usr/bin/env bash
    set -uo pipefail
    failed=0
    log=$(mktemp)
    for i in $(seq {{runs}}); do
      cargo test --release --test service a_running_service_moves -- --include-ignored --nocapture >"$log" 2>&1 ||
        failed=$((failed + 1))
      grep -E "resumed|lost|test result" "$log"
    done
    echo "failed $failed of {{runs}}"

# Faults of the replicated database, many times over, with the distribution
# per kind (docs/postgresql.md): a fresh tools/pg-ha cluster, three idem
# serve, 16 clients, N faults (mix: kill, pause, standby, etcd, switchover,
# partition in turn). The report is out/chaos-faults/chaos_report.md.
chaos-faults faults="24" kind="mix":
    #!/usr/bin/env bash
    set -euo pipefail
    cargo build --release --quiet
    export PG_HA_ROOT=$(mktemp -d) PG_HA_PORT=${PG_HA_PORT:-5500}
    trap 'tools/pg-ha destroy' EXIT
    db=$(tools/pg-ha start)
    target/release/idem chaos --instances 3 --fault {{kind}} --failover {{faults}} --clients 16 \
      --transfers 15 --budget 30s --db "$db" --out out/chaos-faults
