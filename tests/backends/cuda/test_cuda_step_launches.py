"""What a captured cuda decode step launches, counted under the interpreter (tests/support/step_launches.py).

A kernel in a CUDA graph costs the device ~1-2 us however little it computes: at batch 1 a small
model's step time follows its launch count. These tests pin the launches a plain and a
speculative step hold beside their decoder layers (the embedding, final norm and heads, the MTP
stages' glue, acceptance) and per layer, so that per-forward work (an attention plan built of
torch ops was 18 launches a forward) does not creep back in."""
import pytest

from cuda_support import ON_GPU
from mindspec import LLM, SamplingParams
from tests.support.checkpoints import make_checkpoint, tiny_v3_config
from tests.support.step_launches import LaunchCensus

pytestmark = pytest.mark.skipif(ON_GPU, reason="counts the interpreter's launches (a GPU's: scripts/gpu_step_profile.py)")

K = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = tiny_v3_config(num_nextn_predict_layers=K)
    return make_checkpoint(tmp_path_factory.mktemp("v3"), cfg, seed=4), cfg


def _launches(checkpoint, monkeypatch, plugin_params, dtype="float16"):
    path, cfg = checkpoint
    census = LaunchCensus()
    with census.installed(monkeypatch):
        llm = LLM(model=str(path), backend="cuda", device="cpu", dtype=dtype, cache_block_size=4, num_blocks=64,
                  progress=False, plugin_params=plugin_params, max_batch_size=1)
        llm.generate([[3, 17, 42, 9, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    return census, cfg


def _layer_launches(cfg) -> int:
    """Launches of one decode step's decoder layers. Attention: the fused q_a/kv_a projection
    (adding the residual and applying the input norm inside the GEMM), q_b (normalising q_a
    inside the GEMM), the two absorbed matmuls, latent norm + rope + cache write, attention
    (rotating q_pe as it loads it), o_proj (7); the residual add + norm (1); a MoE MLP: router (with its gate GEMM and the route alignment), gate/up + SwiGLU,
    down, the shared expert's gate/up with its SwiGLU and its down, the combine (routed pairs
    summed, the shared output added) (6); a dense MLP: gate/up with its SwiGLU, down (2)."""
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace)
    return 8 * cfg.num_hidden_layers + 6 * moe_layers + 2 * (cfg.num_hidden_layers - moe_layers)


# Beside the layers of a forward: the embedding, the final norm, the lm_head (its rows gathered
# and its float32 logits written by the skinny GEMM), and the argmax of the greedy token.
FORWARD_GLUE = 4


def test_plain_step_launches_little_beside_its_layers(checkpoint, monkeypatch):
    census, cfg = _launches(checkpoint, monkeypatch, None)
    step = census.last("decode")
    assert step.in_layers == _layer_launches(cfg), step.by_name
    assert step.outside_layers == FORWARD_GLUE, step.by_name


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_speculative_step_launches_little_beside_its_layers(checkpoint, monkeypatch, mode):
    params = {"plugin_type": "mtp", "num_speculative_tokens": K, "mtp_mode": mode, "adaptive_speculation": False}
    census, cfg = _launches(checkpoint, monkeypatch, params)
    step = census.last("speculative")
    # the verification's layers, then each draft stage's MoE block (its attention, norm and MLP);
    # the last stage runs o_proj and its MLP on its lm_head rows alone (o_proj and the norm
    # after it gather their rows as they load them)
    assert step.in_layers == _layer_launches(cfg) + K * 14, step.by_name
    # a draft stage: eh_proj (its input, the embedding and both norms, built inside the GEMM:
    # backends/cuda/eh_proj.py), the lm_head (the block's residual add and the head's norm
    # inside the GEMM, whose first program writes the block output for the next stage; in the
    # model dtype: an argmax needs no float32 copy; where another stage follows, on its lm_head
    # rows alone, gathered inside the GEMM), the argmax (where another stage follows, with that
    # stage's tokens: one kernel, backends/cuda/draft_shift.py) (3; the first stage's eh_proj
    # gathers its hidden states from the drafter's cache too); then the drafts set beside each
    # sequence's last token (one concat: the verification rows, the drafts a view of them) and
    # the acceptance kernel (backends/cuda/acceptance.py, which packs the targets, drafts and
    # accepted counts for one copy to the host)
    stages = 3 * K
    acceptance = 2
    assert step.outside_layers == FORWARD_GLUE + stages + acceptance, step.by_name
