"""The shape of the LoFAST paper's Tables 1 and 2, measured in one run on one machine: certified
accuracy and seconds per sample of LoFAST alone, CROWN alone and the hybrid (LoFAST, then CROWN
on what LoFAST leaves uncertified). Prints a markdown table, writes it and a JSON report.

    OMP_NUM_THREADS=1 python benchmarks/bench_tables.py [--checkpoint CKPT] [--data CIFAR10]
        [--n 100] [--eps 0.02 --eps 0.05 --eps 0.1 | --eps 0.02,0.05,0.1]
        [--method crown|alpha-crown] [--timeout SECONDS] [--crown-dtype float64|float32]
        [--guarantee probabilistic|exact|estimate] [--device auto] [--batch-size B]
        [--out-json bench_tables.json] [--out-md bench_tables.md] [--cache PATH | --no-cache]

Samples: the first --n images of the class-balanced order (i-th image of every class in turn)
of the CIFAR-10 test split at --data, default the sample bundled with lofast.

How each column is measured (every eps is its own experiment, as in the paper's Table 2):

- LoFAST: `Certifier` with the settings of `lofast certify` (bound lofast, kappa 1/2, the
  --guarantee, seed 0, the CLI's default batch size), after an untimed warm-up batch. The
  per-sample quantities do not depend on eps, so one pass certifies every eps; its seconds per
  sample (wall time of certify + the verdicts, over all n samples, / n) is the same in every
  column.
- CROWN alone: `lofast.crown.crown_verify` (what `lofast certify --fallback` runs) at each eps
  on every one of the n samples, one sample per call. Its clean forward pass of the exported
  model skips the samples it misclassifies (0 s each: that forward pass takes milliseconds and
  is not counted; the paper's verifiers skip them the same way). Seconds per sample =
  sum of the per-sample bound times / n. A per-sample time excludes the one-off export and graph
  construction (under a second here, paid once per batch by a batched run); the JSON keeps each
  call's wall time too. A sample past --timeout counts as uncertified and is charged the time
  it used.
- Hybrid (CROWN + LoFAST): certified = LoFAST's certificates plus CROWN's among the samples
  LoFAST classifies correctly but leaves uncertified at that eps (the samples
  `lofast certify --fallback` hands to CROWN). Their CROWN results are the ones computed for
  CROWN alone, not recomputed. Seconds per sample = (LoFAST's time for all n samples + CROWN's
  time on the samples the hybrid sends to it) / n: what the hybrid itself would have spent.
  (`lofast certify --fallback` with several eps also skips a sample at larger eps once CROWN
  failed on it; this benchmark does not, each eps stands alone.)

Resuming: every CROWN result is appended to a JSONL cache (default: --out-json with suffix
.crown.jsonl) under a fingerprint of what it depends on (checkpoint and image hashes, label, eps,
method, dtype, timeout, device, torch threads); a rerun with the same settings reuses matching
lines with the seconds measured then, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from measure import sync  # beside this script

from lofast.certification.certificate import Certifier, CertifySettings
from lofast.certification.records import eps_key
from lofast.checkpoint import checkpoint_path, file_digest, load_checkpoint
from lofast.config import GUARANTEES
from lofast.crown import INSTALL_HINT, METHODS, crown_available, crown_verify
from lofast.data import load_dataset
from lofast.data.sample import class_balanced_order, load_bundled_sample
from lofast.runtime import default_batch_size, device_name, resolve_device

# CIFAR-10, ViT depth 3 width 128, 1,000 test samples; certified accuracy in %.
PAPER_SOURCE = "LoFAST paper, CIFAR-10, ViT depth 3 width 128, 1,000 test samples"
PAPER = {
    "LoFAST (Table 1)": {"certified": {"0.02": 29.1, "0.05": 16.0, "0.1": 3.0}, "seconds": {}},
    "CROWN (Table 2)": {"certified": {"0.02": 41.99, "0.05": 14.35},
                        "seconds": {"0.02": 4.33, "0.05": 6.06}},
    "CROWN + LoFAST (Table 2)": {"certified": {"0.02": 41.99, "0.05": 20.03},
                                 "seconds": {"0.02": 1.71, "0.05": 4.17}},
}
METHOD_NAMES = {"crown": "CROWN", "alpha-crown": "alpha-CROWN"}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_eps(values: list[str]) -> list[float]:
    """--eps values, repeated and/or comma-separated -> sorted distinct positive floats."""
    eps = set()
    for value in values:
        for part in value.split(","):
            number = float(part)
            if not (math.isfinite(number) and number > 0):
                raise SystemExit(f"--eps: {part!r} is not a positive number")
            eps.add(number)
    return sorted(eps)


def git_commit() -> str:
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False,
                              cwd=Path(__file__).resolve().parent)

    commit = git("rev-parse", "--short", "HEAD").stdout.strip()
    if commit and git("status", "--porcelain", "--untracked-files=no").stdout.strip():
        commit += " (uncommitted changes)"
    return commit or "unknown"


def run_lofast(model, x, y, eps, settings, device, batch_size) -> dict:
    """LoFAST on all samples: per-sample verdicts (n, E), margins, radii, predictions and the
    timed total."""
    Certifier(model, settings, device).certify(x[:batch_size], y[:batch_size])  # warm-up
    certifier = Certifier(model, settings, device)  # fresh: same random starts as the CLI
    eps_tensor = torch.tensor(eps, dtype=torch.float64)
    verdicts, margins, radii, predictions = [], [], [], []
    failure, guarantee, seconds = 0.0, settings.method.describe(), 0.0
    for start in range(0, len(x), batch_size):
        xb, yb = x[start:start + batch_size], y[start:start + batch_size]
        sync(device)
        began = time.perf_counter()
        cert = certifier.certify(xb, yb)
        verdict = cert.certified(eps_tensor).cpu()
        sync(device)
        seconds += time.perf_counter() - began
        verdicts.append(verdict)
        margins.append(cert.margin.cpu())
        radii.append(cert.radius().cpu())
        predictions.append(cert.predictions.cpu())
        failure = max(failure, cert.failure_probability)
    if failure > 0:
        guarantee += f"; per-sample failure probability <= {failure:.1e}"
    return {"verdicts": torch.cat(verdicts).tolist(), "margins": torch.cat(margins).tolist(),
            "radii": torch.cat(radii).tolist(), "predictions": torch.cat(predictions).tolist(),
            "seconds": seconds, "guarantee": guarantee}


class CrownCache:
    """CROWN results by key in an append-only JSONL file; lines of other settings are kept in
    the file and ignored, a torn last line (an interrupted write) is dropped."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict] = {}
        if path is None:
            return
        if path.is_file():
            lines = path.read_text(encoding="utf-8").splitlines()
            kept = []
            for number, line in enumerate(lines, 1):
                try:
                    entry = json.loads(line)
                    self.entries[entry["key"]] = entry["result"]
                    kept.append(line)
                except (json.JSONDecodeError, KeyError, TypeError):
                    if number != len(lines):
                        raise SystemExit(f"{path}:{number}: not a bench_tables cache line")
            if len(kept) != len(lines):
                path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        path.parent.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, result: dict) -> None:
        self.entries[key] = result
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "result": result}, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())


def run_crown(model, x, y, image_hashes, eps, args, fingerprint, cache) -> dict[str, list[dict]]:
    """CROWN at every eps on every sample, one sample per call; results[eps_key][j]."""
    results: dict[str, list[dict]] = {}
    for e in eps:
        key = eps_key(e)
        results[key] = []
        spent = 0.0
        for j in range(len(x)):
            cache_key = f"{fingerprint}|{image_hashes[j]}|{int(y[j])}|{key}"
            hit = cache.get(cache_key)
            if hit is not None:
                results[key].append({**hit, "cached": True})
                continue
            began = time.perf_counter()
            (result,) = crown_verify(model, x[j:j + 1], y[j:j + 1], e, method=args.method,
                                     timeout=args.timeout, dtype=DTYPES[args.crown_dtype])
            entry = {"certified": result.certified, "reason": result.reason,
                     "seconds": result.seconds, "margin_bound": result.margin_bound,
                     "wall_seconds": time.perf_counter() - began}
            cache.put(cache_key, entry)
            results[key].append({**entry, "cached": False})
            spent += entry["wall_seconds"]
            if result.reason != "misclassified":
                verdict = "certified" if result.certified else result.reason
                log(f"  {args.method} eps={key} sample {j + 1}/{len(x)}: {verdict} "
                    f"({result.seconds:.1f} s; {spent:.0f} s at this eps so far)")
        reused = sum(r["cached"] for r in results[key])
        if reused:
            log(f"  {args.method} eps={key}: {reused} of {len(x)} results reused from the cache")
    return results


def combine(eps, lofast, crown, labels, n) -> tuple[dict, list[str], list[dict]]:
    """Rows per method and eps, warnings, and per-eps hybrid details; asserts consistency."""
    correct = [p == y for p, y in zip(lofast["predictions"], labels)]
    rows: dict[str, dict] = {"LoFAST": {}, "CROWN": {}, "CROWN + LoFAST": {}}
    warnings: list[str] = []
    details = []
    for k, e in enumerate(eps):
        key = eps_key(e)
        by_lofast = [bool(v[k]) for v in lofast["verdicts"]]
        by_crown = [r["certified"] for r in crown[key]]
        sent = [j for j in range(n) if correct[j] and not by_lofast[j]]
        sent_set = set(sent)
        hybrid = [by_lofast[j] or (j in sent_set and by_crown[j]) for j in range(n)]
        assert all(correct[j] for j in range(n) if by_lofast[j]), "LoFAST certified a mistake"
        assert all(hybrid[j] for j in range(n) if by_lofast[j]), "hybrid lost a LoFAST sample"
        for j in range(n):
            if by_crown[j] and lofast["margins"][j] < 0:
                warnings.append(
                    f"eps={key}: CROWN certified the sample at position {j} whose LoFAST margin is "
                    f"{lofast['margins'][j]:.4g} < 0 (misclassified by the float64 model): the "
                    "exported model and the model disagree; check lofast.crown.export_plain")
            if correct[j] and crown[key][j]["reason"] == "misclassified":
                warnings.append(f"eps={key}: the sample at position {j} is correctly classified by LoFAST's "
                                "float64 model but misclassified by CROWN's exported model")
        crown_seconds = sum(r["seconds"] for r in crown[key])
        sent_seconds = sum(crown[key][j]["seconds"] for j in sent)
        rows["LoFAST"][key] = {"certified": sum(by_lofast), "seconds": lofast["seconds"]}
        rows["CROWN"][key] = {"certified": sum(by_crown), "seconds": crown_seconds}
        rows["CROWN + LoFAST"][key] = {"certified": sum(hybrid),
                                       "seconds": lofast["seconds"] + sent_seconds}
        for row in rows.values():
            row[key]["accuracy"] = row[key]["certified"] / n
            row[key]["seconds_per_sample"] = row[key]["seconds"] / n
        crown_ran = [r for r in crown[key] if r["reason"] != "misclassified"]
        details.append({
            "eps": key,
            "lofast_certified": sum(by_lofast),
            "hybrid_crown_runs": len(sent),
            "hybrid_crown_added": sum(by_crown[j] for j in sent),
            "crown_runs": len(crown_ran),
            "crown_time_limits": sum((r["reason"] or "").startswith("time limit")
                                     for r in crown_ran),
            "crown_other_failures": sum(
                not r["certified"] and not (r["reason"] or "").startswith(("time limit", "margin"))
                for r in crown_ran),
            "lofast_only": sum(by_lofast[j] and not by_crown[j] for j in range(n)),
            "crown_only": sum(by_crown[j] and not by_lofast[j] for j in range(n)),
            "hybrid_verdicts": hybrid,
        })
    return rows, warnings, details


def seconds_text(value: float) -> str:
    return f"{value:#.3g}"


def markdown(report: dict) -> str:
    eps = report["eps"]
    n = report["samples"]
    keys = [eps_key(e) for e in eps]
    head = (["method"] + [f"certified @ {k}" for k in keys]
            + [f"s/sample @ {k}" for k in keys])
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for name, row in report["rows"].items():
        label = report["crown_name"] + " + LoFAST" if name == "CROWN + LoFAST" else (
            report["crown_name"] if name == "CROWN" else name)
        cells = [f"{100 * row[k]['accuracy']:.1f} % ({row[k]['certified']}/{n})" for k in keys]
        cells += [seconds_text(row[k]["seconds_per_sample"]) for k in keys]
        lines.append(f"| {label} (this run) | " + " | ".join(cells) + " |")
    for name, row in PAPER.items():
        cells = [f"{row['certified'][k]} %" if k in row["certified"] else "-" for k in keys]
        cells += [f"{row['seconds'][k]}" if k in row["seconds"] else "-" for k in keys]
        lines.append(f"| paper: {name} | " + " | ".join(cells) + " |")
    config = report["model"]
    env = report["environment"]
    timeout = f"{report['timeout']:g} s" if report["timeout"] else "none"
    reused = (f"; {report['crown_cached']} CROWN results reused from {report['cache']}"
              if report["crown_cached"] else "")
    setup = (f"Model `{report['checkpoint']}` (depth {config['depth']}, width "
             f"{config['width']}); {n} samples of {report['data']}, class-balanced order; clean "
             f"accuracy {100 * report['clean_accuracy']:.1f} %.\n"
             f"LoFAST: bound lofast, kappa 1/2, {report['lofast_guarantee']}; batch size "
             f"{report['batch_size']}. {report['crown_name']}: auto_LiRPA via lofast.crown, "
             f"{report['crown_dtype']}, time limit {timeout} per sample.\n"
             f"Torch threads {env['torch_threads']} (OMP_NUM_THREADS={env['omp_num_threads']}), "
             f"torch {env['torch']}, commit {env['commit']}; started {report['started']}, "
             f"finished {report['finished']}{reused}.")
    how = (f"Paper rows: {PAPER_SOURCE}, on their hardware. Certified % of all samples "
           "(misclassified ones count as not certified). LoFAST certifies every eps in one "
           "pass, so its time is the same in every column. CROWN alone runs at each eps on "
           "every sample its clean forward pass classifies correctly (misclassified samples "
           "cost 0 s); the hybrid runs it only on the samples LoFAST leaves uncertified at that "
           "eps (the same results are reused), and its time is LoFAST's for all samples plus "
           "CROWN's on those, over n.")
    out = [f"## LoFAST Tables 1 and 2, measured on {env['device']} ({env['device_name']})",
           "", setup, "", *lines, "", how, ""]
    for d in report["eps_details"]:
        out.append(
            f"- eps {d['eps']}: LoFAST certified {d['lofast_certified']}; the hybrid ran "
            f"{report['crown_name']} on {d['hybrid_crown_runs']} and it added "
            f"{d['hybrid_crown_added']}. {report['crown_name']} alone ran on {d['crown_runs']} "
            f"({d['crown_time_limits']} hit the time limit, {d['crown_other_failures']} other "
            f"failures); certified by LoFAST only {d['lofast_only']}, by "
            f"{report['crown_name']} only {d['crown_only']}.")
    if report["warnings"]:
        out += ["", "**WARNINGS**", ""] + [f"- {w}" for w in report["warnings"]]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None,
                        help="model (default: the shipped default checkpoint)")
    parser.add_argument("--data", type=Path, default=None,
                        help="CIFAR-10 (default: the sample bundled with lofast)")
    parser.add_argument("--n", type=int, default=100, help="samples (default 100)")
    parser.add_argument("--eps", action="append", default=None,
                        help="l2 radius, repeatable or comma-separated (default 0.02,0.05,0.1)")
    parser.add_argument("--method", choices=METHODS, default="crown")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds CROWN may spend on one sample (default: no limit)")
    parser.add_argument("--crown-dtype", choices=list(DTYPES), default="float64",
                        help="CROWN's precision (default float64, as lofast certify --fallback)")
    parser.add_argument("--guarantee", choices=list(GUARANTEES), default="exact")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="LoFAST batch (default: as lofast certify, 16 on CPU, 256 on GPU)")
    parser.add_argument("--out-json", type=Path, default=Path("bench_tables.json"))
    parser.add_argument("--out-md", type=Path, default=Path("bench_tables.md"))
    parser.add_argument("--cache", type=Path, default=None,
                        help="CROWN results JSONL (default: --out-json with .crown.jsonl)")
    parser.add_argument("--no-cache", action="store_true", help="recompute every CROWN result")
    args = parser.parse_args()
    eps = parse_eps(args.eps or ["0.02,0.05,0.1"])
    if args.n < 1:
        parser.error("--n must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        parser.error("--timeout must be positive")
    if not crown_available():
        raise SystemExit(f"bench_tables needs auto_LiRPA; install it with: {INSTALL_HINT}")

    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    device = resolve_device(args.device)
    checkpoint = checkpoint_path(args.checkpoint)
    model = load_checkpoint(checkpoint, device)
    batch_size = args.batch_size or default_batch_size(device, model.config.num_tokens)
    if args.data is None:
        data, data_name = load_bundled_sample(), "the bundled CIFAR-10 test sample"
    else:
        data, data_name = load_dataset(args.data, "test", "cifar10"), f"CIFAR-10 test ({args.data})"
    order = class_balanced_order(data.labels)[: args.n]
    subset = data.subset(order)
    n = len(subset)
    x, y = subset.to_tensors()
    labels = y.tolist()
    image_hashes = [hashlib.sha256(image.tobytes()).hexdigest()[:16] for image in subset.images]

    env = {"device": str(device), "device_name": device_name(device),
           "torch_threads": torch.get_num_threads(),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
           "torch": torch.__version__, "python": platform.python_version(),
           "host": platform.node(), "commit": git_commit()}
    if env["omp_num_threads"] == "unset":
        log("note: OMP_NUM_THREADS is unset; on a shared machine set OMP_NUM_THREADS=1")

    log(f"LoFAST on {n} samples, eps {', '.join(map(eps_key, eps))} ...")
    settings = CertifySettings(guarantee=args.guarantee)
    lofast = run_lofast(model, x, y, eps, settings, device, batch_size)
    log(f"  {lofast['seconds']:.2f} s ({lofast['seconds'] / n:.3f} s/sample)")

    checkpoint_hash = file_digest(checkpoint)
    fingerprint = hashlib.sha256(json.dumps({
        "checkpoint": checkpoint_hash, "method": args.method, "dtype": args.crown_dtype,
        "timeout": args.timeout, "device": env["device"], "device_name": env["device_name"],
        "threads": env["torch_threads"]}, sort_keys=True).encode()).hexdigest()[:16]
    cache_path = None if args.no_cache else (args.cache or args.out_json.with_suffix(".crown.jsonl"))
    cache = CrownCache(cache_path)
    log(f"{METHOD_NAMES[args.method]} on every sample at each eps"
        + (f" (results cached in {cache_path})" if cache_path else "") + " ...")
    crown = run_crown(model, x, y, image_hashes, eps, args, fingerprint, cache)

    rows, warnings, details = combine(eps, lofast, crown, labels, n)
    if warnings:
        log("\n" + "!" * 78 + "\nWARNING: CROWN and LoFAST disagree on these samples:")
        for w in warnings:
            log(f"  {w}")
        log("!" * 78 + "\n")

    samples = []
    for j in range(n):
        samples.append({
            "position": j, "index": int(order[j]), "image_sha256": image_hashes[j],
            "label": labels[j], "prediction": lofast["predictions"][j],
            "margin": lofast["margins"][j], "radius": lofast["radii"][j],
            "lofast": {eps_key(e): bool(lofast["verdicts"][j][k]) for k, e in enumerate(eps)},
            "crown": {eps_key(e): crown[eps_key(e)][j] for e in eps},
            "hybrid": {d["eps"]: d["hybrid_verdicts"][j] for d in details},
        })
    for d in details:
        del d["hybrid_verdicts"]
    report = {
        "description": __doc__,
        "checkpoint": str(checkpoint), "checkpoint_sha256": checkpoint_hash,
        "model": json.loads(model.config.to_json()),
        "data": data_name, "samples": n, "eps": eps,
        "clean_accuracy": sum(p == t for p, t in zip(lofast["predictions"], labels)) / n,
        "method": args.method, "crown_name": METHOD_NAMES[args.method],
        "crown_dtype": args.crown_dtype, "timeout": args.timeout,
        "guarantee": args.guarantee, "lofast_guarantee": lofast["guarantee"],
        "batch_size": batch_size, "lofast_seconds": lofast["seconds"],
        "cache": str(cache_path) if cache_path else None,
        "crown_cached": sum(r["cached"] for results in crown.values() for r in results),
        "environment": env, "started": started,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows": rows, "eps_details": details, "warnings": warnings,
        "paper": {"source": PAPER_SOURCE, "rows": PAPER},
        "per_sample": samples,
    }
    text = markdown(report)
    print(text)
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out_json, "w") as f:
        json.dump(report, f, indent=2, allow_nan=False)
    args.out_md.parent.mkdir(parents=True, exist_ok=True)
    args.out_md.write_text(text, encoding="utf-8")
    log(f"wrote {args.out_json} and {args.out_md}")


if __name__ == "__main__":
    main()
