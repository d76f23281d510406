"""What the tests under tests/gpu share: the marks that skip them without CUDA, prompts, the
transformers reference on the device, a tie-aware greedy comparison, and where numbers are written.

Every test module sets ``pytestmark = GPU``: marked ``gpu`` (so ``pytest -m gpu --collect-only``
lists them anywhere) and skipped, with the reason, where torch sees no CUDA device. transformers
is imported inside the functions, so collecting these tests costs only torch and moeflow.

The rehearsal (``MOEFLOW_GPU_REHEARSAL=1``): the same tests on the CPU, ``cuda-ipc`` replaced by its
rehearsal ``deferred`` (the same handles and ownership rules over host memory), decode attention
on the batched path a GPU takes and the KV handoff's copy by torch slices, as on a GPU, so that every GPU test's logic runs in the CPU suite
(``tests/integration/test_gpu_rehearsal.py``); what only a GPU can show is skipped there, saying so.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
REHEARSAL = os.environ.get("MOEFLOW_GPU_REHEARSAL", "") not in ("", "0")
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA and not REHEARSAL, reason="needs a CUDA device (torch sees "
                                           "none; MOEFLOW_GPU_REHEARSAL=1 runs them on the CPU)")]
DEVICE = "cpu" if REHEARSAL else "cuda"
TRANSPORT = "deferred" if REHEARSAL else "cuda-ipc"  # between processes: device memory by handle, or its rehearsal
if REHEARSAL:  # the rehearsal is a pytest run of its own: decode attention and the KV handoff's copy on a
    os.environ["MOEFLOW_PAGED_ATTENTION"] = "batched"  # GPU's path, for every worker too
    os.environ["MOEFLOW_KV_COPY"] = "torch"
RESULTS_ENV = "MOEFLOW_GPU_CHECK_OUT"  # verify/gpu_check.sh points it at $OUT/results


def gpu_only(what: str) -> None:
    """Skip the rest of a test in the rehearsal: ``what`` is a fact of a GPU, not of the logic."""
    if REHEARSAL:
        pytest.skip(f"rehearsal on the CPU: {what} is a GPU's")


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (rehearsal)"


def prompts(seed: int, vocab_size: int, lengths: tuple[int, ...] | list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def hf_on_device(path: str, dtype: torch.dtype):
    """The transformers model of a checkpoint on the GPU, eval mode, stopping at no EOS: it decodes
    exactly ``max_new_tokens`` as moeflow's ``ignore_eos`` does, and no logits processor masks EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def hf_generate(model, batch: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuations of equally long prompts in one batched ``generate`` (no padding)."""
    assert len({len(p) for p in batch}) == 1, "one batch without padding needs equal lengths"
    ids = torch.tensor(batch, device=DEVICE)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[:, ids.shape[1]:].tolist()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[n, V] float32 on the CPU: row i is HF's log-distribution of the token after position i."""
    return model(torch.tensor([prompt], device=DEVICE)).logits[0].float().log_softmax(-1).cpu()


def matching_prefix(ours: list[int], ref: list[int]) -> int:
    """How many leading tokens two continuations share."""
    n = 0
    for a, b in zip(ours, ref):
        if a != b:
            break
        n += 1
    return n


@torch.no_grad()
def assert_greedy_matches(model, prompt: list[int], ours: list[int], ref: list[int], tie_atol: float) -> None:
    """Equal, or equal up to a genuine tie of HF's top-2 logits (after which both may go their way)."""
    assert len(ours) == len(ref), (len(ours), len(ref))
    i = matching_prefix(ours, ref)
    if i == len(ref):
        return
    logits = model(torch.tensor([prompt + ref[:i]], device=DEVICE)).logits[0, -1].float()
    top = logits.topk(2)
    gap = (top.values[0] - top.values[1]).item()
    assert gap < tie_atol and {ours[i], ref[i]} == set(top.indices.tolist()), (
        f"greedy diverges at new token {i} (moeflow {ours[i]}, HF {ref[i]}) without a tie: "
        f"HF top-2 {top.indices.tolist()} differ by {gap:.3g}")


def record(name: str, data: dict) -> None:
    """Print one result line and, under the GPU check, write it: ``$MOEFLOW_GPU_CHECK_OUT/<name>.json``,
    or one line of ``$MOEFLOW_GPU_CHECK_OUT`` when that is a ``.jsonl`` file (gpu_run.sh: few files come back)."""
    line = json.dumps(data, sort_keys=True)
    print(f"RESULT {name} {line}")
    out = os.environ.get(RESULTS_ENV)
    if out and out.endswith(".jsonl"):
        with open(out, "a") as f:
            f.write(json.dumps({"name": name, **data}, sort_keys=True) + "\n")
    elif out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            f.write(line + "\n")
