"""The reference model against transformers' DeepseekV3ForCausalLM: logits and greedy continuations."""

import pytest
import torch

from hf_models import CONFIGS, make_hf_model, save_hf_model
from mtp_trt.exporters.generate import greedy_generate
from mtp_trt.exporters.loader import load_checkpoint

# Both sides compute in fp32 with the same operations up to summation order: 1e-4 absolute on logits
# of magnitude ~1-10 leaves room for reordering and nothing for a wrong formula (those show up as >1e-2).
ATOL, RTOL = 1e-4, 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    hf = make_hf_model(request.param)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_checkpoint(path)


def test_logits_match_transformers(pair):
    hf, ours = pair
    tokens = torch.randint(0, hf.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        got, hidden, latents = ours(tokens)
    err = (got - ref).abs()
    worst = divmod(int(err.argmax()), ref.shape[-1])
    assert torch.allclose(got, ref, atol=ATOL, rtol=RTOL), f"max |diff| {err.max():.3g} at (row, vocab) {worst}"
    assert ref.std() > 0.1, "logits too flat for the comparison to mean anything"
    assert len(latents) == hf.config.num_hidden_layers
    assert latents[0].shape == (3, 24, hf.config.kv_lora_rank + hf.config.qk_rope_head_dim)


def test_greedy_continuation_matches_transformers_generate(pair):
    hf, ours = pair
    prompt = torch.randint(0, hf.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, 7:].tolist()
    eos = (hf.generation_config.eos_token_id,)  # generate stops there; so must we
    assert greedy_generate(ours, prompt[0].tolist(), 16, absorbed=True, eos_ids=eos) == ref
    assert greedy_generate(ours, prompt[0].tolist(), 16, absorbed=False, eos_ids=eos) == ref
