"""app.utils.faults: the named fault-injection points (their use by the product is tested where
the faults strike: tests/unit/test_checkpoint_commit.py sees every save stage in order,
tests/integration/test_rollback.py poisons training losses)."""
import pytest

from app.utils import faults


def test_an_unknown_point_is_refused_with_the_known_ones_named():
    with pytest.raises(ValueError, match=r"unknown fault-injection point 'checkpoint\.save'; the "
                                         r"points are checkpoint\.save_stage, training\.loss"):
        faults.arm("checkpoint.save", print)
    with pytest.raises(ValueError, match="must be callable"):
        faults.arm(faults.SAVE_STAGE, None)


def test_injected_handlers_nest_and_are_removed_when_the_block_raises():
    seen = []
    assert faults.fire(faults.SAVE_STAGE, "start") is None  # nothing armed: nothing called
    with faults.injected(faults.SAVE_STAGE, lambda stage: seen.append(("outer", stage))):
        with pytest.raises(RuntimeError):
            with faults.injected(faults.SAVE_STAGE, lambda stage: seen.append(("inner", stage))):
                faults.fire(faults.SAVE_STAGE, "start")
                raise RuntimeError("the body failed")
        faults.fire(faults.SAVE_STAGE, "rotated")
    faults.fire(faults.SAVE_STAGE, "rotated")
    assert seen == [("inner", "start"), ("outer", "rotated")]
    assert faults.armed(faults.SAVE_STAGE) is None


def test_a_handler_returns_the_value_the_point_uses():
    faults.arm(faults.TRAINING_LOSS, lambda first_sample, loss: loss * first_sample)
    assert faults.fire(faults.TRAINING_LOSS, 3, 2.0) == 6.0
    faults.disarm(faults.TRAINING_LOSS)
    assert faults.armed(faults.TRAINING_LOSS) is None
