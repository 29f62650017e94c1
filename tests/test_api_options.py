"""The search's options are built once (:func:`potluck.api.search_options`), by the CLI as by
Python callers, and :func:`potluck.api.plan` takes them whole or as keywords, not both."""

import pytest

from potluck import api
from potluck.errors import ConfigError
from potluck.examples import example_path
from potluck.model.counts import Recompute
from potluck.planner.options import Partition, SearchOptions
from potluck.plans.memory import Offload, Swap
from potluck.schedules import Schedule


def test_flag_values_become_the_options_auto_left_to_the_search():
    options = api.search_options(tp=2, recompute="selective", swap="auto", offload="none",
                                 partition="uniform", schedule="gpipe", zero=1, top_k=3)
    assert options == SearchOptions(tp=2, recompute=Recompute.SELECTIVE, swap=None,
                                    offload=Offload.NONE, partition=Partition.UNIFORM,
                                    schedule=Schedule.GPIPE, zero=1, top_k=3)
    assert api.search_options() == SearchOptions()
    assert api.search_options(swap=Swap.HOST).swap is Swap.HOST


def test_a_technique_the_search_does_not_know_is_one_line():
    with pytest.raises(ConfigError, match="'sometimes' is not one of"):
        api.search_options(recompute="sometimes")


def test_options_and_pins_together_are_refused():
    with pytest.raises(ConfigError, match="not both"):
        api.plan(example_path("two-fast-two-slow.yaml"), "tiny-llama",
                 options=api.search_options(tp=1), pp=2)
