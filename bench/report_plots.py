"""The report's plots (matplotlib, Agg backend), drawn from the results ``bench.all``
collected: ``resume_time.png`` (time to a decodable session against context, per path,
log-log, min to max over repeats), ``fidelity.png`` (KL, top-1 agreement and bits/byte
change against the replay length R, per context), ``trace_hit_rate.png`` (block hit rate
in the fast tiers against hbm capacity, per policy)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

RESUME_PATHS = ("prefill", "host", "disk", "disk-grpc", "object", "naive")
PATH_LABELS = {"prefill": "full re-prefill", "host": "host tier (window kept)",
               "disk": "disk tier + replay", "disk-grpc": "disk + replay via gRPC server",
               "object": "object tier (zstd) + replay",
               "naive": "naive torch.save/load of bf16 K/V"}


def plot_resume(stage: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    contexts = [row["context"] for row in stage["contexts"]]
    for name in RESUME_PATHS:
        rows = [(row["context"], row["paths"][name]) for row in stage["contexts"]
                if "seconds" in row["paths"].get(name, {})]
        if rows:
            # the best repeat, with a bar from the fastest to the slowest repeat
            spread = [p.get("repeat_seconds") or [p["seconds"]] for _, p in rows]
            best = [p["seconds"] for _, p in rows]
            ax.errorbar([n for n, _ in rows], best, capsize=3, marker="o",
                        yerr=[[b - min(t) for b, t in zip(best, spread, strict=True)],
                              [max(t) - b for b, t in zip(best, spread, strict=True)]],
                        linestyle="--" if name == "disk-grpc" else "-",
                        label=PATH_LABELS[name])
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time to a decodable session (s)")
    ax.set_title("Resume vs re-prefill, bundled model, CPU (bars: min..max of repeats)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fidelity(stage: dict, path: Path) -> None:
    replays = sorted({int(n[2:]) for row in stage["contexts"] for n in row["variants"]
                      if n.startswith("R=") and n != "R=0"})
    names = ["window-only", "R=0", *(f"R={r}" for r in replays), "exact"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    panels = (("kl_nats", "mean KL vs never-evicted (nats)"),
              ("top1_agreement", "top-1 agreement"),
              ("bpb_rel_diff", "bits/byte change (%)"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for row in stage["contexts"]:
            present = [n for n in names if n in row["variants"]]
            values = [row["variants"][n][key] * (100 if key == "bpb_rel_diff" else 1)
                      for n in present]
            ax.plot([names.index(n) for n in present], values, marker="o",
                    label=f"{row.get('kind', 'context')} {row['context']}")
        ax.set_xticks(range(len(names)), names)
        ax.set_xlabel("replay length (exact = window kept; window-only = no global KV)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    goal = stage["goal"]
    axes[0].axhline(goal["kl_at_most"], color="red", linestyle="--", linewidth=1)
    axes[1].axhline(goal["top1_at_least"], color="red", linestyle="--", linewidth=1,
                    label=f"goal at R={goal['replay_tokens']}")
    for sign in (1, -1):
        axes[2].axhline(sign * 100 * goal["bpb_within"], color="red", linestyle="--",
                        linewidth=1)
    axes[0].set_yscale("symlog", linthresh=1e-9)
    axes[0].set_ylim(bottom=0)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Fidelity after resume over the next {stage['follow_tokens']} held-out bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_trace(stage: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (("reuse_fast_value", "hbm + host hits / re-reads, windows weighed as replays"),
              ("reuse_fast_hit_rate", "hbm + host block hits / re-reads (first reads excluded)"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for policy in stage["policies"]:
            points = sorted((r["capacity_fraction"], r[key]) for r in stage["results"]
                            if r["policy"] == policy)
            ax.plot(*zip(*points, strict=True), marker="o", label=policy)
        ax.set_xscale("log")
        fractions = sorted({r["capacity_fraction"] for r in stage["results"]})
        ax.set_xticks(fractions, [f"{f:g}" for f in fractions])
        ax.minorticks_off()
        ax.set_xlabel("hbm capacity / unique-block footprint (host = "
                      f"{stage['tiers']['host_ratio']:g} x hbm)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("block hit rate")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Trace {Path(stage['trace']['path']).name}: "
                 f"{stage['trace']['requests']} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- sections --
