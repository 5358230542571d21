"""core/patcher.py on its own: instance-level changes and their undo, and the pickling guard."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from megatrain_hf.core.patcher import Patcher


class Box:
    kind = "class value"


def user_hook(module, args, output):  # module level: picklable
    return output


def our_hook(module, args, output):
    return output * 0


def our_forward(x):
    return x * 0


def _module():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    m[0].register_buffer("shift", torch.arange(3.0))
    return m


# ---------------------------------------------------------------------- attributes
def test_set_attr_then_undo_restores_the_instance_value():
    box = Box()
    box.value = 1
    patcher = Patcher()
    patcher.set_attr(box, "value", 2)
    assert box.value == 2
    patcher.undo()
    assert box.value == 1 and vars(box) == {"value": 1}


def test_set_attr_of_a_class_attribute_is_removed_at_undo():
    box = Box()
    patcher = Patcher()
    patcher.set_attr(box, "kind", "patched")
    assert box.kind == "patched" and Box.kind == "class value"  # the class stays untouched
    patcher.undo()
    assert "kind" not in vars(box) and box.kind == "class value"


def test_set_attr_twice_undoes_to_the_original():
    box = Box()
    box.value = "original"
    patcher = Patcher()
    patcher.set_attr(box, "value", "first")
    patcher.set_attr(box, "value", "second")
    patcher.undo()
    assert box.value == "original"


def test_an_attribute_replaced_since_is_left_alone():
    box = Box()
    box.forward = "original"
    patcher = Patcher()
    patcher.set_attr(box, "forward", "ours")
    box.forward = "theirs"  # e.g. TRL patching a forward on top of ours
    patcher.undo()
    assert box.forward == "theirs"
    patcher.set_attr(box, "other", "ours")  # the patcher is usable again after undo
    patcher.undo()
    assert not hasattr(box, "other")


def test_undo_runs_in_reverse_order_and_once():
    box = Box()
    ran = []
    patcher = Patcher()
    patcher.on_undo(lambda: ran.append("first"))
    patcher.set_attr(box, "value", 1)
    patcher.on_undo(lambda: ran.append(("second", box.value)))
    patcher.undo()
    assert ran == [("second", 1), "first"]  # the later change is undone first
    patcher.undo()
    assert len(ran) == 2


def test_set_item_then_undo():
    m = _module()
    original = m[0]._buffers["shift"]
    patcher = Patcher()
    patcher.set_item(m[0], "_buffers", "shift", torch.zeros(3))
    assert torch.equal(m[0].shift, torch.zeros(3))
    patcher.undo()
    assert m[0]._buffers["shift"] is original


def test_hooks_are_removed_at_undo():
    m = _module()
    fired = []
    patcher = Patcher()
    patcher.hook(m, m.register_forward_hook(lambda mod, a, o: fired.append("ours")))
    m.register_forward_hook(lambda mod, a, o: fired.append("user"))
    m(torch.randn(1, 3))
    assert fired == ["ours", "user"]
    patcher.undo()
    fired.clear()
    m(torch.randn(1, 3))
    assert fired == ["user"]


def test_temporarily():
    box = Box()
    box.value = 1
    patcher = Patcher()
    with patcher.temporarily(box, "value", 2):
        assert box.value == 2
    assert box.value == 1
    with pytest.raises(ZeroDivisionError):
        with patcher.temporarily(box, "kind", "inside"):
            assert box.kind == "inside"
            1 / 0
    assert "kind" not in vars(box) and box.kind == "class value"  # restored on error too, and removed


# ---------------------------------------------------------------------- pickling guard
def _patch(patcher: Patcher, m: nn.Sequential):
    patcher.set_attr(m, "forward", our_forward)
    patcher.set_attr(m[0], "engine_marker", "ours")
    patcher.set_item(m[0], "_buffers", "shift", torch.full((3,), -1.0))
    patcher.hook(m[0], m[0].register_forward_hook(our_hook))
    patcher.hook(m[0], m[0].register_forward_pre_hook(lambda mod, args, kwargs: None, with_kwargs=True))


def _check_clean(copy_: nn.Sequential, original: nn.Sequential):
    assert "forward" not in vars(copy_) and "__getstate__" not in vars(copy_)
    assert "engine_marker" not in vars(copy_[0]) and "__getstate__" not in vars(copy_[0])
    assert torch.equal(copy_[0].shift, torch.arange(3.0))  # the original buffer
    assert list(copy_[0]._forward_hooks.values()) == [user_hook]  # the user's hook stays, ours goes
    assert not copy_[0]._forward_pre_hooks and not copy_[0]._forward_pre_hooks_with_kwargs
    x = torch.randn(2, 3)
    assert torch.equal(copy_(x), nn.functional.relu(original[0].weight @ x.T + original[0].bias[:, None]).T)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_patched_module_copies_without_the_patches(how):
    m = _module()
    m[0].register_forward_hook(user_hook)
    patcher = Patcher()
    _patch(patcher, m)
    dup = pickle.loads(pickle.dumps(m)) if how == "pickle" else copy.deepcopy(m)
    _check_clean(dup, m)
    # the live module keeps its patches
    assert vars(m)["forward"] is our_forward and m[0].engine_marker == "ours"
    assert torch.equal(m[0].shift, torch.full((3,), -1.0)) and len(m[0]._forward_hooks) == 2
    patcher.undo()
    assert "__getstate__" not in vars(m) and "__getstate__" not in vars(m[0])
    _check_clean(copy.deepcopy(m), m)  # after undo: an ordinary module


def test_torch_save_of_a_patched_module(tmp_path):
    m = _module()
    m[0].register_forward_hook(user_hook)
    patcher = Patcher()
    _patch(patcher, m)
    torch.save(m, tmp_path / "m.pt")
    _check_clean(torch.load(tmp_path / "m.pt", weights_only=False), m)
    patcher.undo()


def test_before_pickle_runs_first():
    m = _module()
    calls = []

    def before():
        calls.append("before")
        with torch.no_grad():
            m[0].weight.fill_(0.5)  # e.g. the background update finishing its write

    patcher = Patcher(before_pickle=before)
    patcher.set_attr(m, "forward", our_forward)
    dup = copy.deepcopy(m)
    assert calls == ["before"]
    assert torch.all(dup[0].weight == 0.5)  # the copy holds what before_pickle left
    pickle.dumps(m)
    assert calls == ["before", "before"]
    patcher.undo()
    copy.deepcopy(m)
    assert len(calls) == 2  # no guard after undo


def test_a_buffer_set_twice_pickles_as_the_original():
    m = _module()
    patcher = Patcher()
    patcher.set_item(m[0], "_buffers", "shift", torch.full((3,), -1.0))
    patcher.set_item(m[0], "_buffers", "shift", torch.full((3,), -2.0))
    assert torch.equal(copy.deepcopy(m)[0].shift, torch.arange(3.0))
    patcher.undo()
    assert torch.equal(m[0].shift, torch.arange(3.0))


def test_an_attribute_set_twice_pickles_as_the_original():
    m = _module()
    m.note = "original"
    patcher = Patcher()
    patcher.set_attr(m, "note", "first")
    patcher.set_attr(m, "note", "second")
    assert copy.deepcopy(m).note == "original"
    patcher.undo()


def test_plain_objects_get_no_guard():
    box = Box()
    patcher = Patcher()
    patcher.set_attr(box, "value", 1)
    assert "__getstate__" not in vars(box)
    assert pickle.loads(pickle.dumps(box)).value == 1  # not a module: pickled as it is
    patcher.undo()
