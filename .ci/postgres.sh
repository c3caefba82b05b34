# shellcheck shell=bash
# Start a throwaway PostgreSQL for the test suite. Source it, don't run it:
#
#     source .ci/postgres.sh        # starts the server, exports the DSN
#     pytest tests/stores
#     tailrace_pg_stop              # or let the EXIT trap do it
#
# The server listens on a unix socket in a fresh temp dir only (no TCP), with
# fsync off (a test server loses nothing that matters), room for 300
# connections (each worker holds its pool, its LISTEN, its store session and its
# watch), and a database `tailrace_test`. It exports
#     TAILRACE_TEST_POSTGRES_DSN=postgresql://postgres@/tailrace_test?host=$TAILRACE_PG_DIR
# If TAILRACE_TEST_POSTGRES_DSN is already set, that server is used and nothing
# is started. As root, the server runs as the `postgres` user (initdb refuses
# root); otherwise as the current user. Set TAILRACE_PG_BINDIR to use another
# PostgreSQL installation (default /usr/lib/postgresql/15/bin).
#
# An EXIT trap stops the server, unless the caller already has an EXIT trap:
# then the caller must call tailrace_pg_stop itself (a message says so).

_tailrace_pg_as_owner() {
    if [ "$(id -u)" -eq 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

tailrace_pg_stop() {
    # Stop the server this script started (by its data dir, hence its own
    # postmaster PID), then remove its files. Safe to call more than once.
    if [ -n "${TAILRACE_PG_DIR:-}" ] && [ -d "$TAILRACE_PG_DIR" ]; then
        local bindir="${TAILRACE_PG_BINDIR:-/usr/lib/postgresql/15/bin}"
        local pidfile="$TAILRACE_PG_DIR/data/postmaster.pid"
        if [ -f "$pidfile" ]; then
            if ! _tailrace_pg_as_owner "$bindir/pg_ctl" -D "$TAILRACE_PG_DIR/data" \
                -m fast -w -t 30 stop >/dev/null; then
                kill -TERM "$(head -n 1 "$pidfile")" 2>/dev/null || true
            fi
        fi
        rm -rf "$TAILRACE_PG_DIR"
        if [ "${TAILRACE_TEST_POSTGRES_DSN:-}" = "${_TAILRACE_PG_DSN:-}" ]; then
            unset TAILRACE_TEST_POSTGRES_DSN
        fi
    fi
    unset TAILRACE_PG_DIR _TAILRACE_PG_DSN
}

tailrace_pg_start() {
    if [ -n "${TAILRACE_TEST_POSTGRES_DSN:-}" ]; then
        echo "postgres.sh: using the server at TAILRACE_TEST_POSTGRES_DSN" >&2
        return 0
    fi
    local bindir="${TAILRACE_PG_BINDIR:-/usr/lib/postgresql/15/bin}"
    if [ ! -x "$bindir/initdb" ]; then
        echo "postgres.sh: no PostgreSQL at $bindir (set TAILRACE_PG_BINDIR)" >&2
        return 1
    fi
    TAILRACE_PG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/tailrace-pg.XXXXXX")" || return 1
    export TAILRACE_PG_DIR
    if [ "$(id -u)" -eq 0 ]; then
        chown postgres:postgres "$TAILRACE_PG_DIR" || { tailrace_pg_stop; return 1; }
    fi
    local dir="$TAILRACE_PG_DIR"
    if ! _tailrace_pg_as_owner "$bindir/initdb" -D "$dir/data" -U postgres -A trust \
        -E UTF8 --no-sync >"$dir/initdb.log" 2>&1; then
        echo "postgres.sh: initdb failed:" >&2
        cat "$dir/initdb.log" >&2
        tailrace_pg_stop
        return 1
    fi
    if ! _tailrace_pg_as_owner "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-k $dir -c listen_addresses='' -c fsync=off -c max_connections=300" start >/dev/null; then
        echo "postgres.sh: the server did not start:" >&2
        cat "$dir/server.log" >&2
        tailrace_pg_stop
        return 1
    fi
    local tries=0
    until "$bindir/pg_isready" -q -h "$dir" -U postgres; do
        tries=$((tries + 1))
        if [ "$tries" -ge 100 ]; then
            echo "postgres.sh: the server is not ready after 10s" >&2
            tailrace_pg_stop
            return 1
        fi
        sleep 0.1
    done
    if ! "$bindir/createdb" -h "$dir" -U postgres tailrace_test; then
        tailrace_pg_stop
        return 1
    fi
    _TAILRACE_PG_DSN="postgresql://postgres@/tailrace_test?host=$dir"
    export TAILRACE_TEST_POSTGRES_DSN="$_TAILRACE_PG_DSN"
    if [ -z "$(trap -p EXIT)" ]; then
        trap tailrace_pg_stop EXIT
    else
        echo "postgres.sh: an EXIT trap is already set; call tailrace_pg_stop yourself" >&2
    fi
    echo "postgres.sh: PostgreSQL ready at $dir (pid $(head -n 1 "$dir/data/postmaster.pid"))" >&2
}

tailrace_pg_start
