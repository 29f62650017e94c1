"""Family evaluations are shared where their inputs are: over memory levels and pickling."""

import pickle

from potluck.cluster.topology import Cluster
from potluck.model.counts import Recompute
from potluck.planner.cost import CostModel
from potluck.planner.families import FamilyEvaluator, FamilySetting
from potluck.planner.space import UnitLayout
from potluck.plans import TrainingShape
from potluck.schedules import AUTO_SCHEDULE


def _setting(zero: int, offload: bool = False) -> FamilySetting:
    return FamilySetting(1, Recompute.NONE, AUTO_SCHEDULE, 1, zero, False, 16, offload)


def _evaluator(spec, model) -> tuple[FamilyEvaluator, tuple]:
    cluster = Cluster(spec)
    families = FamilyEvaluator(cluster, CostModel.for_training(cluster, model, TrainingShape(16, 1024)))
    return families, ((spec.nodes[0], 1),)


def test_one_pipeline_is_evaluated_once_for_every_zero_stage(a100_node, small_model):
    families, order = _evaluator(a100_node, small_model)
    option = families.evaluate(order, 1, UnitLayout.PIPELINE, _setting(0))
    assert option is not None
    assert all(families.evaluate(order, 1, UnitLayout.PIPELINE, _setting(z)) is option
               for z in (1, 2, 3))
    assert families.evaluate(order, 1, UnitLayout.PIPELINE, _setting(0, offload=True)) is not option


def test_replicas_are_evaluated_for_their_own_zero_stage(a100_node, small_model):
    families, order = _evaluator(a100_node, small_model)
    plain, sharded = (families.evaluate(order, 2, UnitLayout.PIPELINE, _setting(z)) for z in (0, 3))
    assert plain is not None and sharded is not None and plain is not sharded
    assert sharded.optimizer_s < plain.optimizer_s  # each replica steps its shard


def test_a_pickled_setting_hashes_as_a_new_one():
    setting = _setting(1)
    hash(setting)
    copy = pickle.loads(pickle.dumps(setting))
    assert copy == setting and "_hash" not in copy.__dict__ and hash(copy) == hash(setting)
