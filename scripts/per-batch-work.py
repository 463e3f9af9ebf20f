#!/usr/bin/env python3
"""Device work per batch of every GPU stage of the 22 TPC-H queries, counted, not timed.

Each query runs twice under EXPLAIN ANALYZE on an emulated device with the GPU forced, once
with fulmen.gpu.batch_rows = 1 048 576 and once with 65 536; for each GPU operator whose
device batches grow, the difference in launches and host syncs over the extra batches is
what one more batch costs it (docs/benchmarks.md, "Device work per batch").

Usage: scripts/per-batch-work.py [--binary $CARGO_TARGET_DIR/debug/fulmen] [--sf 0.1] [--queries 1,6]
"""
import argparse
import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def operators(binary, sf, sql, rows):
    out = subprocess.run(
        [binary, "--demo", str(sf), "-q", "--devices", "emulated:1",
         "-c", "SET fulmen.gpu.mode = 'force'",
         "-c", f"SET fulmen.gpu.batch_rows = {rows}",
         "-c", "EXPLAIN ANALYZE " + sql],
        capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        m = re.search(r"(Gpu\w+Exec): .*metrics=\[(.*?)\]", line)
        if not m:
            continue
        metrics = dict(re.findall(r"(\w+)=([0-9.]+)(?:[ ,\]]|$)", m.group(2)))
        mode = re.search(r"mode=(\w+)", line)
        name = m.group(1) + (f"({mode.group(1)})" if mode else "")
        count = lambda k: int(float(metrics.get(k, 0)))
        found.append((name, count("gpu_batches"), count("launches"), count("syncs")))
    return found


def main():
    args = argparse.ArgumentParser()
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    args.add_argument("--binary", default=str(target / "debug/fulmen"))
    args.add_argument("--sf", default="0.1")
    args.add_argument("--queries", default=",".join(str(q) for q in range(1, 23)))
    a = args.parse_args()
    for q in [int(q) for q in a.queries.split(",")]:
        sql = (ROOT / f"engine/src/tpch_queries/q{q:02d}.sql").read_text().strip().rstrip(";")
        big = operators(a.binary, a.sf, sql, 1 << 20)
        small = operators(a.binary, a.sf, sql, 1 << 16)
        if [o[0] for o in big] != [o[0] for o in small]:
            print(f"Q{q}: the plans differ between the two runs")
            continue
        for (name, b1, l1, s1), (_, b2, l2, s2) in zip(big, small):
            if b2 > b1:
                print(f"Q{q} {name}: {(l2 - l1) / (b2 - b1):.1f} launches, "
                      f"{(s2 - s1) / (b2 - b1):.1f} host syncs per device batch "
                      f"({b1} -> {b2} batches)", flush=True)


if __name__ == "__main__":
    main()
