"""What a run leaves in output.dir (DESIGN §8): model.pt and summary.json, whatever the mode."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from hetpipe import data as datasets
from hetpipe.config import JobConfig
from hetpipe.reference import initial_model


def write(job: JobConfig, weights: OrderedDict[str, torch.Tensor], fields: dict[str, Any]) -> dict[str, Any]:
    """Saves the final state_dict (layer order) and the summary: fields, plus `accuracy` on the
    job's dataset when it is a classification task. Returns the summary."""
    out_dir = Path(job.resolve(job.output.dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out_dir / "model.pt")
    summary = dict(fields)
    dataset = datasets.load_dataset(job)
    if dataset.classification:
        model = initial_model(job)
        model.load_state_dict(weights)
        summary["accuracy"] = accuracy(model, dataset)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@torch.no_grad()
def accuracy(model: torch.nn.Module, dataset: datasets.Dataset, batch: int = 1024) -> float:
    """Fraction of rows (or tokens) whose argmax prediction matches the label."""
    correct = total = 0
    for i in range(0, dataset.rows, batch):
        pred = model(dataset.x[i : i + batch]).argmax(dim=-1)
        target = dataset.y[i : i + batch]
        correct += int((pred == target).sum())
        total += target.numel()
    return correct / total
