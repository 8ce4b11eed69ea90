"""Chapter 04's check that the floor's weights (counted from the config) and the built model's
tensors agree shows its arithmetic: the embedding's rows a step does not read, written out."""
import pytest

from kit.config import load
from kit.engine.kv_cache import KVCacheLayout
from kit.measure.roofline import decode_step_cost, weights_reconciled


@pytest.mark.parametrize("model", ["tiny", "tiny-gemma4"])
def test_the_floor_plus_what_a_step_does_not_read_is_every_weight(model):
    s = load("cpu-small", model=model)
    cost = decode_step_cost(s.arch, s.dtype_bytes, KVCacheLayout.for_settings(s).specs,
                            [130] * s.batch_size, None)
    total, arithmetic = weights_reconciled(s.arch, cost, s.batch_size, s.dtype_bytes)
    assert total == s.arch.num_parameters() * s.dtype_bytes
    assert arithmetic.startswith(f"{cost.weight_bytes:,} B (the floor's) + embedding ")
    assert arithmetic.endswith(f" = {total:,} B")
    if model == "tiny":  # untied: the input embedding is read at the batch's rows only
        assert f"({s.arch.vocab_size:,} − {s.batch_size}) rows × {s.arch.hidden_size}" \
            in arithmetic
