"""Runs TPC-H queries on DuckDB for fulmen-bench.

Reads a JSON request on stdin: {"data_dir": ..., "tables": [...], "queries": [[name, sql], ...],
"iterations": N}. Writes one JSON object per line: {"query": name, "times_ms": [...],
"rows": [[cell, ...], ...]} with cells as strings (NULL for nulls), or {"query": name,
"error": "..."}. Exits 3 when the duckdb package is missing.
"""
import json
import sys
import time

try:
    import duckdb
except ImportError:
    sys.exit(3)


def cell(v):
    if v is None:
        return "NULL"
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return str(v)


def main():
    req = json.load(sys.stdin)
    con = duckdb.connect()
    for t in req["tables"]:
        con.execute(f"CREATE VIEW {t} AS SELECT * FROM read_parquet('{req['data_dir']}/{t}.parquet')")
    print(json.dumps({"version": duckdb.__version__}), flush=True)
    for name, sql in req["queries"]:
        try:
            # One untimed run gives the answer and warms up, as for the other engines.
            rows = [[cell(v) for v in r] for r in con.execute(sql).fetchall()]
            times = []
            for _ in range(req["iterations"]):
                start = time.perf_counter()
                con.execute(sql).fetchall()
                times.append((time.perf_counter() - start) * 1000.0)
            print(json.dumps({"query": name, "times_ms": times, "rows": rows}), flush=True)
        except Exception as e:  # a failing query is reported, the others still run
            print(json.dumps({"query": name, "error": str(e)}), flush=True)


main()
