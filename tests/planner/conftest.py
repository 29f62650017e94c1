"""Shared small clusters and models for planner tests."""

from dataclasses import replace

import pytest

from potluck.cluster import parse_cluster
from potluck.model import load_model


@pytest.fixture
def small_model():
    """GPT-3 1.3B's block shape with 8 layers: real FLOPs and memory, small search spaces."""
    return replace(load_model("gpt3-1.3b"), num_layers=8, name="gpt-1.3b-8l")


@pytest.fixture
def a100_node():
    return parse_cluster("nodes: [{name: a100, gpu: a100-80g-sxm, gpus_per_node: 8}]", "a100.yaml")


def mixed(text: str):
    return parse_cluster(text, "mixed.yaml")
