"""What `tandem bench` writes: the JSON record, two PNG plots and a table on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import time

from tandem.bench import synthetic


def write_json(result: dict, path: str) -> None:
    """The record at `path`, paths under the current directory written relative to it: a record is kept in
    the repository, where the checkout's own location means nothing to the next reader. Compact (no
    indentation): a sweep's record with every run's step trace was 1.25 MB indented and 0.5 MB compact, and
    the repository travels whole to the machines that measure (`python -m json.tool` reads it back)."""
    with open(path, "w") as f:
        json.dump(relative_paths(result, os.getcwd()), f, separators=(",", ":"))
        f.write("\n")


def revision() -> str | None:
    """The git commit of the tandem source being measured (short hash, "-dirty" with uncommitted changes
    under it), or None outside a git checkout: a record names the code it measured."""
    from tandem import envs

    if envs.record_commit():
        return envs.record_commit()
    src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the tandem package
    try:
        def git(*args):
            return subprocess.run(["git", "-C", src, *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def default_out(kind: str) -> str:
    """bench/results/<kind>-<commit>.json, or with the time in place of a commit outside a checkout."""
    return os.path.join("bench", "results", f"{kind}-{revision() or time.strftime('%Y%m%d-%H%M%S')}.json")


def relative_paths(value, root: str):
    """`value` with every string that is an absolute path under `root` made relative to it (dicts, lists)."""
    if isinstance(value, dict):
        return {k: relative_paths(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_paths(v, root) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        inside = os.path.commonpath([root, os.path.normpath(value)]) == root
        return os.path.relpath(value, root) if inside else value
    return value


def plot(result: dict, stem: str) -> list[str]:
    """`<stem>-throughput.png` (tokens/s and speedup vs batch size) and, with speculation,
    `<stem>-acceptance.png` (acceptance per draft position). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    rows = result["batches"]
    sizes = [r["batch_size"] for r in rows]
    label = result.get("label")
    title = f"tandem bench: {result['model']['name']} ({result['device']}, {result['dtype']})"
    if label:
        title += f"\n{label} (p={result['synthetic_acceptance']['p']})"
    paths = []

    fig, (ax_tps, ax_speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, name, style in (("spec_on", "speculation on", "o-"), ("spec_off", "speculation off", "s-"),
                             ("hf", "transformers generate", "^--")):
        pts = [(r["batch_size"], r[key]["tokens_per_s"]) for r in rows if r.get(key) and "tokens_per_s" in r[key]]
        if pts:
            ax_tps.plot(*zip(*pts), style, label=name)
    ax_tps.set(xscale="log", xlabel="batch size", ylabel="output tokens/s", title="throughput")
    ax_tps.legend()
    pts = [(r["batch_size"], r["speedup"]) for r in rows if r.get("speedup") is not None]
    if pts:
        ax_speed.plot(*zip(*pts), "o-", label="speculation on / off")
        ax_speed.axhline(1.0, color="grey", lw=0.8)
        ax_speed.legend()
    ax_speed.set(xscale="log", xlabel="batch size", ylabel="speedup (tokens/s ratio)", title="speedup")
    for ax in (ax_tps, ax_speed):
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
    fig.suptitle(title, fontsize=10, color="red" if label else "black")
    fig.tight_layout()
    paths.append(f"{stem}-throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    accept = [r for r in rows if r.get("spec_on") and r["spec_on"].get("accept_per_position")]
    if accept:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for r in accept:
            per_pos = r["spec_on"]["accept_per_position"]
            ax.plot(range(1, len(per_pos) + 1), per_pos, "o-",
                    label=f"batch {r['batch_size']} (mean length {r['spec_on']['mean_accept_length']:.2f})")
        expected = (result.get("synthetic_acceptance") or {}).get("expected_mean_accept_length")
        if expected is not None:  # a chain under synthetic acceptance: position k is reached with p^k
            p, depth = result["synthetic_acceptance"]["p"], len(accept[0]["spec_on"]["accept_per_position"])
            ax.plot(range(1, depth + 1), synthetic.reach_probabilities(p, depth), "k--", lw=1,
                    label=f"expected (mean length {expected:.2f})")
        ax.set(xlabel="draft position", ylabel="share of verify steps accepting it", ylim=(0, 1.05),
               title="acceptance per position")
        ax.set_xticks(range(1, len(accept[0]["spec_on"]["accept_per_position"]) + 1))
        ax.legend(fontsize=8)
        fig.suptitle(title, fontsize=10, color="red" if label else "black")
        fig.tight_layout()
        paths.append(f"{stem}-acceptance.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def table(result: dict) -> str:
    """A fixed-width summary, one line per batch size."""
    lines = []
    label = result.get("label")
    if label:
        lines.append(f"*** {label} (p={result['synthetic_acceptance']['p']}) ***")
    lines.append(f"{'batch':>5} {'spec tok/s':>11} {'plain tok/s':>11} {'speedup':>7} {'spec ms/tok':>11} "
                 f"{'plain ms/tok':>12} {'spec iter ms':>12} {'accept len':>10} {'hf tok/s':>9} {'hf match':>8}")

    def num(v, width: int, fmt: str) -> str:
        return format(v, f"{width}{fmt}") if isinstance(v, (int, float)) else "-".rjust(width)

    for r in result["batches"]:
        on, off, hf = r.get("spec_on") or {}, r.get("spec_off") or {}, r.get("hf") or {}
        match = (hf.get("match_spec_off") or hf.get("match_spec_on") or {}).get("requests_equal")
        lines.append(" ".join([
            f"{r['batch_size']:>5}", num(on.get("tokens_per_s"), 11, ".1f"), num(off.get("tokens_per_s"), 11, ".1f"),
            num(r.get("speedup"), 7, ".2f"), num(on.get("ms_per_output_token"), 11, ".2f"),
            num(off.get("ms_per_output_token"), 12, ".2f"), num(on.get("iteration_ms"), 12, ".2f"),
            num(on.get("mean_accept_length"), 10, ".2f"), num(hf.get("tokens_per_s"), 9, ".1f"),
            num(match, 8, ".0%")]))
    if label:
        lines.append(f"*** {label} ***")
    return "\n".join(lines)
