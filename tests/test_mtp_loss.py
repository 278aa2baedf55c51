"""The MTP head's loss (issue 55), single device: targets are the SFT labels shifted once more
and never cross a packed document's end; the head's weights learn from it; ``detach`` leaves
every gradient of the base model as the main loss alone gives it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from autopar.data.loader import IGNORE_INDEX
from autopar.models import build_model, get_flavor
from autopar.training.objectives.mtp.loss import mtp_labels, mtp_loss_sum, vocab_argmax

IGN = IGNORE_INDEX


def test_targets_are_the_labels_shifted_once_more():
    labels = torch.tensor([[IGN, IGN, 12, 13, 14, IGN]])  # a prompt of 3 tokens, the answer 12..14
    assert mtp_labels(labels).tolist() == [[IGN, 12, 13, 14, IGN, IGN]]  # nothing two past the end


def test_targets_never_cross_a_packed_document_end():
    # tokens x0..x5, documents [0 0 0 | 1 1 1]: label j is token j+1
    labels = torch.tensor([[101, 102, 103, 104, 105, IGN]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 1]])
    # i=0 -> x2 (all in document 0); i=1, i=2: x3 starts document 1; i=3 -> x5; i=4, 5: no label
    assert mtp_labels(labels, documents).tolist() == [[102, IGN, IGN, 105, IGN, IGN]]


def test_acceptance_counts_the_argmax_hitting_the_token_two_ahead():
    labels = torch.tensor([[5, 6, 7, 8, IGN]])
    targets = [6, 7, 8, 1]
    logits = F.one_hot(torch.tensor([[6, 7, 3, 1, 2]]), 10).float()  # right, right, wrong, ignored x2
    loss, accepted, counted = mtp_loss_sum(logits, mtp_labels(labels))
    assert (accepted.item(), counted.item()) == (2, 3)
    assert loss.item() == F.cross_entropy(logits[0, :3], torch.tensor(targets[:3]), reduction="sum").item()


def model_and_batch():
    args = dataclasses.replace(get_flavor("qwen3.5", "debug"), mtp_num_hidden_layers=1)
    model = build_model(args)
    model.init_weights(seed=4)
    x = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    labels = torch.cat([x[:, 1:], torch.full_like(x[:, :1], IGN)], dim=1)
    labels[:, :10] = IGN  # a prompt
    documents = (torch.arange(40) >= 25).long().expand(2, -1)
    return model, x, labels, documents


def losses(model, x, labels, documents, detach: bool) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, _ = model.trunk(x, documents=documents)
    main = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), labels.flatten(), ignore_index=IGN)
    logits, _ = model.mtp_logits_from(hidden, x, documents, detach=detach)
    head, _, counted = mtp_loss_sum(logits, mtp_labels(labels, documents))
    return main, head / counted


def test_the_head_learns_from_its_loss():
    model, x, labels, documents = model_and_batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.")}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(5):
        main, head = losses(model, x, labels, documents, detach=False)
        (main + 0.1 * head).backward()
        optimizer.step()
        optimizer.zero_grad()
        first = head.item() if first is None else first
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    assert losses(model, x, labels, documents, detach=False)[1].item() < first


def base_grads(model, x, labels, documents, scale: float, detach: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    main, head = losses(model, x, labels, documents, detach)
    (main + scale * head).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if not n.startswith("mtp.")}


def test_detach_leaves_the_base_gradients_as_the_main_loss_gives_them():
    model, x, labels, documents = model_and_batch()
    alone = base_grads(model, x, labels, documents, scale=0.0, detach=True)
    detached = base_grads(model, x, labels, documents, scale=0.1, detach=True)
    assert all(torch.equal(detached[n], alone[n]) for n in alone)
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "mtp." in n
    )
    # without detach the head's loss reaches the trunk, the embedding and the output head
    joint = base_grads(model, x, labels, documents, scale=0.1, detach=False)
    changed = {n for n in alone if not torch.equal(joint[n], alone[n])}
    assert {"embed_tokens.weight", "lm_head.weight", "norm.weight"} <= changed


def argmax_of_vocab_shards(logits: torch.Tensor) -> torch.Tensor:
    """On each of two gloo ranks: ``vocab_argmax`` of ``logits`` split over the vocabulary."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    return vocab_argmax(distribute_tensor(logits, mesh, [Shard(2)]))


@pytest.mark.slow
def test_acceptance_under_loss_parallel_takes_the_argmax_over_every_ranks_columns():
    from autopar.cli.spawn import run_on_ranks

    # 11 columns: rank 0 holds 0..5, rank 1 holds 6..10 (torch.chunk's split); winners on both
    # ranks, and a tie between column 2 and column 8 that argmax gives to the first
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    logits[0, 0, 9] = logits[1, 2, 1] = 10.0
    logits[1, 1, 2] = logits[1, 1, 8] = 20.0
    expected = logits.argmax(dim=-1)
    assert expected[0, 0] == 9 and expected[1, 2] == 1 and expected[1, 1] == 2
    for found in run_on_ranks(argmax_of_vocab_shards, 2, logits):
        assert torch.equal(found, expected)
