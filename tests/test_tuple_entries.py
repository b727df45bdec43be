"""A top-level state entry that is a tuple holding tensors (``state["stats"] = ((t, 1), "x")``,
a NamedTuple of tensors) is restored on load. DCP stores a tuple whole (one item, its tensors
inside); the load used to leave the live tuple untouched, silently: it had nothing to merge
into. Its tensors now load into the live ones in place where they fit."""

from __future__ import annotations

from typing import NamedTuple

import torch

import distckpt


class Moments(NamedTuple):
    mean: torch.Tensor
    count: int


def test_a_tuple_entry_with_tensors_is_restored(tmp_path):
    saved = {
        "stats": ((torch.full((4,), 7.0), 1), "x"),
        "moments": Moments(torch.arange(3.0), 5),
        "nested": {"pair": (torch.ones(2), "a")},
        "step": 1,
    }
    with distckpt.Checkpointer(tmp_path, save_rng=False, safe_types=(Moments,)) as ckpt:
        ckpt.save(1, saved)
    live = torch.zeros(4)
    fresh = {
        "stats": ((live, 0), "y"),
        "moments": Moments(torch.zeros(3), 0),
        "nested": {"pair": (torch.zeros(2), "b")},
        "step": 0,
    }
    with distckpt.Checkpointer(tmp_path, save_rng=False, safe_types=(Moments,)) as ckpt:
        assert ckpt.load(fresh) == 1
    (t, n), s = fresh["stats"]
    assert torch.equal(t, torch.full((4,), 7.0)) and (n, s) == (1, "x")
    assert t is live  # loaded into the live tensor, in place
    assert isinstance(fresh["moments"], Moments) and torch.equal(fresh["moments"].mean, torch.arange(3.0))
    assert fresh["moments"].count == 5
    assert torch.equal(fresh["nested"]["pair"][0], torch.ones(2)) and fresh["nested"]["pair"][1] == "a"
    assert fresh["step"] == 1


def test_a_tuple_entry_whose_tensor_changed_shape_takes_the_saved_one(tmp_path):
    with distckpt.Checkpointer(tmp_path, save_rng=False) as ckpt:
        ckpt.save(1, {"stats": (torch.arange(6.0), 2)})
    fresh = {"stats": (torch.zeros(3), 0)}
    with distckpt.Checkpointer(tmp_path, save_rng=False) as ckpt:
        ckpt.load(fresh)
    assert torch.equal(fresh["stats"][0], torch.arange(6.0)) and fresh["stats"][1] == 2


def test_a_tuple_of_tensors_into_a_plain_placeholder_names_the_mismatch(tmp_path):
    """A tuple holding tensors saved, ``None`` given to load it into: "checkpoint entry 'v' is not
    a distckpt plain value (tuple stored)", an IntegrityError that reads like a damaged
    checkpoint. It says which entry and what to give instead (found by a helper, 2026-11-29)."""
    import pytest
    import torch

    import distckpt

    with distckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"v": (torch.ones(2), 5), "p": 3})
        state = {"v": None, "p": 0}
        with pytest.raises(distckpt.StateMismatchError, match=r"v: checkpoint a 'tree' entry .* vs state a plain value \(NoneType\)") as caught:
            ck.load(state)
        assert set(caught.value.kinds) == {"v"}
        state = {"v": (torch.zeros(2), 0), "p": 0}
        assert ck.load(state) == 1 and state["v"][1] == 5 and state["p"] == 3


def test_tuples_inside_a_tree_take_their_tensors_in_place(tmp_path):
    """A tuple inside a dict or list of the state (stored whole, as a tuple entry is): its tensors
    were replaced by the host copies the read made, the live ones (which the caller may hold, on
    their own device) left with their old values. Found by a helper (2026-12-06)."""
    state = {"tree": {"pair": (torch.full((2,), 3.0), 4), "items": [(torch.ones(1), "a")]}}
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    pair, item = torch.zeros(2), torch.zeros(1)
    fresh = {"tree": {"pair": (pair, 0), "items": [(item, "b")]}}
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load(fresh)
    assert fresh["tree"]["pair"][0] is pair and torch.equal(pair, torch.full((2,), 3.0)) and fresh["tree"]["pair"][1] == 4
    assert fresh["tree"]["items"][0][0] is item and torch.equal(item, torch.ones(1)) and fresh["tree"]["items"][0][1] == "a"


def test_tuples_inside_a_tree_that_cannot_be_written_in_place_or_hold_no_tensor_keep_loading(tmp_path):
    """Review of the in-place merge above: live tensors that cannot be written (an inference
    tensor: validation losses kept as ``(loss, epoch)``; an ``expand``ed one) take the loaded
    values as new tensors, as before, rather than failing the load; a tuple holding no tensor
    (a ``torch.Size``) keeps its saved type. Found by a review helper (2026-12-06)."""
    with torch.inference_mode():
        losses = [torch.tensor(2.0), torch.tensor(1.5)]
    state = {"tree": {"history": [(losses[0], 0), (losses[1], 1)], "pair": (torch.arange(4.0), 4), "shape": torch.Size([2, 3]),
                      "shapes": [torch.Size([4])]}}  # fmt: skip
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    with torch.inference_mode():
        stale = [torch.tensor(0.0), torch.tensor(0.0)]
    fresh = {"tree": {"history": [(stale[0], 0), (stale[1], 0)], "pair": (torch.zeros(1).expand(4), 0), "shape": torch.Size([0]),
                      "shapes": [torch.Size([0])]}}  # fmt: skip
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load(fresh)
    tree = fresh["tree"]
    assert [(float(t), e) for t, e in tree["history"]] == [(2.0, 0), (1.5, 1)]
    assert torch.equal(tree["pair"][0], torch.arange(4.0)) and tree["pair"][1] == 4
    assert type(tree["shape"]) is torch.Size and tree["shape"] == torch.Size([2, 3])
    assert type(tree["shapes"][0]) is torch.Size and tree["shapes"] == [torch.Size([4])]


def test_sparse_tensors_in_tuples_load_in_place_and_tuples_take_the_live_type(tmp_path):
    """Review of the writability check above: sparse tensors have no strides to overlap (CSR
    raised inside the check and failed the load; COO was taken for overlapping and replaced); a
    live NamedTuple of plain values given a plain tuple saved before the code changed is
    rebuilt as the NamedTuple, as before. Found by a review helper (2026-12-06)."""

    class Pair(NamedTuple):
        a: int
        b: str

    dense = torch.full((3, 3), 5.0)
    state = {"csr": (dense.to_sparse_csr(), 1), "coo": (dense.to_sparse(), 1), "tree": {"nt": (1, "x"), "w": torch.ones(2)}}
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    csr, coo = torch.ones(3, 3).to_sparse_csr(), torch.ones(3, 3).to_sparse()
    fresh = {"csr": (csr, 0), "coo": (coo, 0), "tree": {"nt": Pair(0, ""), "w": torch.zeros(2)}}
    with distckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.load(fresh)
    assert fresh["csr"][0] is csr and torch.equal(csr.to_dense(), dense)
    assert fresh["coo"][0] is coo and torch.equal(coo.to_dense(), dense)
    assert fresh["tree"]["nt"] == Pair(1, "x") and type(fresh["tree"]["nt"]) is Pair
