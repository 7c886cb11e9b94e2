"""The one binder of torch modules to engine arenas: what a processed module holds is published,
and every engine's module is bound to the arena's read-only views of it.

Used by `shared_module` and by the vLLM loader (`expert_arena.vllm`); both publish through
`open_engine`. What a module holds is found by walking it, not by a list of names: every
parameter, every buffer, and every tensor attribute of every submodule (a torch.Tensor in the
module's `__dict__`: MLA's `W_UV`/`W_UK_T`, kernels' prepacked tensors and scales that a
post-processing step stores as plain attributes), and of the helper objects a module keeps
that post-process weights themselves (an attention backend's `impl`: vLLM's AMX MLA packs W_UK
and W_UV there), named `module.attribute.leaf`. A tensor reachable under several names (tied
weights, an attribute that is a buffer) is published once, under the first name.

Each tensor is published in the order of its storage (a transposed or permuted tensor keeps
its strides: the arena holds its bytes as they lie, and the view bound to it is permuted back),
so what an engine binds has the dtype, shape and strides the building engine's module had. The
arena also holds `MANIFEST`, a small JSON table of every name with its kind (parameter, buffer
or attribute), dtype, shape and strides and the names it is also reachable under: the binder
checks each tensor of the module against it (name, dtype, shape, strides) and refuses a
mismatch naming both sides, and sets the attributes that an engine's own post-processing does
not make when it runs on weights that are already processed.
"""

from __future__ import annotations

import collections
import contextlib
import json

MANIFEST = "expert_arena.module"
MANIFEST_VERSION = 1

Entry = collections.namedtuple("Entry", "name tensor kind arena_name")
Entry.__doc__ = """One tensor of a module: its full name, the tensor, its kind ("parameter",
"buffer" or "attribute") and the arena name it is published under (the first name of the
tensor: tied names share one arena tensor)."""


class BindingError(ValueError):
    """A module does not match the arena it is bound to (names, dtypes, shapes or strides)."""


def module_tensors(module, skip=()):
    """[Entry] of every parameter, buffer and tensor attribute of `module` and its submodules
    (tied ones under each of their names, shared submodules too), in module order. Attribute
    names in `skip` (leaf names) are left out."""
    import torch
    out = []
    first = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        head = prefix + "." if prefix else ""
        for table, kind in ((sub._parameters, "parameter"), (sub._buffers, "buffer")):
            for leaf, t in table.items():
                if t is not None:
                    name = head + leaf
                    out.append(Entry(name, t, kind, first.setdefault(id(t), name)))
        for leaf, t in vars(sub).items():
            # nn.Module keeps parameters, buffers and submodules in their own tables: what is
            # left in __dict__ that is a tensor is state a layer made for itself.
            if isinstance(t, torch.Tensor) and leaf not in skip and t.numel() > 0:
                name = head + leaf
                out.append(Entry(name, t, "attribute", first.setdefault(id(t), name)))
    # A helper's own tensors, after every module's: what it holds of theirs (the weights it
    # was given) keeps the module's name and is retargeted with it, not published again.
    for helper_name, helper in _helpers(module):
        for leaf, t in vars(helper).items():
            if isinstance(t, torch.Tensor) and leaf not in skip and t.numel() > 0 and \
                    id(t) not in first:
                name = helper_name + "." + leaf
                out.append(Entry(name, t, "attribute", first.setdefault(id(t), name)))
    return out


def _is_helper(obj):
    """An object a module keeps that post-processes weights itself (an attention backend's
    `impl`): neither a tensor nor a module, with a `process_weights_after_loading`."""
    import torch
    return not isinstance(obj, (torch.Tensor, torch.nn.Module, type)) and \
        callable(getattr(type(obj), "process_weights_after_loading", None)) and \
        isinstance(getattr(obj, "__dict__", None), dict)


def dtype_name(dtype):
    """The arena's (safetensors) name of a torch dtype: "F32", "BF16", ..."""
    from . import _load_torch
    name = _load_torch()._STREAM_NAMES.get(dtype)
    if name is None:
        raise TypeError("expert_arena: torch dtype %s has no arena name" % dtype)
    return name.upper()


def torch_dtype_of(name):
    """The torch dtype of an arena dtype name ("F32", "BF16", ...)."""
    from . import _load_torch
    for dtype, stream_name in _load_torch()._STREAM_NAMES.items():
        if stream_name.upper() == name:
            return dtype
    raise TypeError("expert_arena: arena dtype %s has no torch dtype" % name)


def _storage_order(t):
    """The permutation that makes `t` C-contiguous without moving a byte (its dimensions by
    decreasing stride), or None when its elements are not one dense block (a slice with gaps,
    an expanded dimension): such a tensor is published contiguous."""
    if t.is_contiguous():
        return list(range(t.dim()))
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    if t.permute(order).is_contiguous():
        return order
    return None


def _contiguous_stride(shape):
    stride, step = [], 1
    for size in reversed(list(shape)):
        stride.insert(0, step)
        step *= max(size, 1)
    return stride


def _layout(entry):
    """What the manifest records of an entry's tensor (its strides as the building engine's
    module had them, which a module is checked against), and the dimension order it is
    written in (identity for a tensor that is not one dense block: it is published, and
    bound, contiguous)."""
    t = entry.tensor
    order = _storage_order(t)
    layout = {"kind": entry.kind, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
              "stride": list(t.stride()), "order": order or list(range(t.dim()))}
    if order is None:
        layout["contiguous"] = True
    return layout, layout["order"]


def declare(module, built, constructed=None, engine=None):
    """The engine table of everything `module` holds (each tensor once) plus MANIFEST; kept in
    `built` for fill(). `constructed`, when known, are the names the module held before its
    post-processing: the others are marked "made" (an engine's post-processing makes them
    again, or they are set from the arena). `engine`: a JSON-able record of the building
    engine's own state that goes with the bytes (engine_record() reads it back)."""
    layouts, tensors, aliases = {}, {}, collections.defaultdict(list)
    for entry in module_tensors(module):
        if entry.arena_name != entry.name:
            aliases[entry.arena_name].append(entry.name)
            continue
        layouts[entry.name], order = _layout(entry)
        if constructed is not None and entry.name not in constructed:
            layouts[entry.name]["made"] = True
        before = constructed.get(entry.name) if isinstance(constructed, dict) else None
        if before is not None and [before[k] for k in ("dtype", "shape", "stride")] != \
                [layouts[entry.name][k] for k in ("dtype", "shape", "stride")]:
            # Post-processing gave it another layout (a repacked conv weight, a weight it
            # released): an engine built on the meta device takes the arena's (take_processed).
            layouts[entry.name]["constructed"] = before
        tensors[entry.name] = (entry.tensor, order)
    for name, names in aliases.items():
        layouts[name]["aliases"] = names
    doc = {"version": MANIFEST_VERSION, "tensors": layouts}
    if engine is not None:
        doc["engine"] = engine
    manifest = json.dumps(doc, sort_keys=True).encode()
    built["entries"] = list(tensors.items())
    built["manifest"] = manifest
    built["freed"] = _freed_by_release(tensors.values())
    table = []
    for name, (t, order) in built["entries"]:
        table.append((name, dtype_name(t.dtype), [t.shape[d] for d in order],
                      t.numel() * t.element_size(), 0))
    table.append((MANIFEST, "U8", [len(manifest)], len(manifest), 0))
    return table


def fill(built, writer, release=False):
    """Writes what declare() listed. `release`: each tensor in the CPU's memory whose bytes lie
    as they are published (dense, in storage order) is then moved onto its bytes in the arena
    (its `data` set to them), so the engine's own copy is freed as the build goes wherever
    nothing else holds it, and its memory becomes the next tensors' pages: the build holds the
    model about once, not twice. The module is bound to the arena's views afterwards as
    before; a build that fails leaves the moved tensors empty (forget_released), never over
    memory that is gone."""
    import numpy as np
    import torch
    entries = built["entries"]
    released = built.setdefault("released", [])
    # Tensors whose private bytes outlive the fill (not moved onto the arena's): freed when
    # the module is bound to its views, by a garbage collection where they sit in a cycle.
    built["kept"] = 0
    try:
        for i, (_, (t, order)) in enumerate(entries):
            flat = t.detach().permute(order).to("cpu").contiguous().reshape(-1)
            if flat.dtype != torch.uint8:
                flat = flat.view(torch.uint8)
            writer.write(i, flat.numpy())
            del flat
            if release and _lies_as_published(t, order):
                with torch.no_grad():
                    t.data = torch.frombuffer(writer.buffer(i), dtype=torch.uint8).view(
                        t.dtype).as_strided(t.shape, t.stride())
                released.append(t)
            elif t.numel() > 0:
                built["kept"] += 1
        writer.write(len(entries), np.frombuffer(built["manifest"], dtype=np.uint8))
    except BaseException:
        forget_released(built)
        raise


def _freed_by_release(entries):
    """The bytes fill(release=True) frees for certain: the CPU storages whose every holder is a
    tensor it moves (torch's count of the storage's holders says none else holds it). 0 where
    torch cannot count them (before 2.0)."""
    import torch
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or not hasattr(torch.Tensor, "untyped_storage"):
        return 0
    groups = collections.defaultdict(list)  # storage address -> [(tensor, moves)]
    for t, order in entries:
        if t.device.type == "cpu" and t.numel() > 0 and t.layout == torch.strided:
            groups[t.untyped_storage().data_ptr()].append((t, _lies_as_published(t, order)))
    freed = 0
    for members in groups.values():
        if all(moves for _, moves in members):
            storage = members[0][0].untyped_storage()
            # Each moved tensor holds the storage once, and so does `storage` here.
            if use_count(storage._cdata) == len(members) + 1:
                freed += storage.nbytes()
    return freed


def _lies_as_published(t, order):
    import torch
    return (t.device.type == "cpu" and t.layout == torch.strided and t.numel() > 0 and
            not t.is_quantized and t.permute(order).is_contiguous())


def forget_released(built):
    """After a failed build: the tensors fill() moved onto the arena's bytes become empty
    (the arena's memory goes with the failure), so that a module kept past it raises at
    their use rather than reading unmapped memory."""
    import torch
    for t in built.pop("released", ()):
        with torch.no_grad():
            t.data = torch.empty(0, dtype=t.dtype)


def _manifest_doc(arena):
    doc = json.loads(bytes(arena.numpy(MANIFEST)).decode())
    if doc.get("version") != MANIFEST_VERSION:
        raise BindingError("expert_arena: the arena %s was published by another version "
                           "of this package (module manifest version %r, this one reads "
                           "%d); remove the file" % (arena.report["path"],
                                                     doc.get("version"), MANIFEST_VERSION))
    return doc


def engine_record(arena):
    """What declare() was given as `engine`, or None (not given, or an arena without a
    MANIFEST)."""
    return _manifest_doc(arena).get("engine") if MANIFEST in arena else None


def manifest(arena):
    """{name: layout} of the arena's MANIFEST; for an arena published without one (an older
    version of this package) each table entry as a contiguous tensor of unknown kind."""
    if MANIFEST in arena:
        return _manifest_doc(arena)["tensors"]
    out = {}
    for info in arena.tensors():
        shape = list(info["shape"])
        out[info["name"]] = {"kind": None, "dtype": info["dtype"], "shape": shape,
                             "stride": _contiguous_stride(shape),
                             "order": list(range(len(shape)))}
    return out


def _describe(kind, dtype, shape, stride):
    return "%s %s %s strides %s" % (kind or "tensor", dtype, list(shape), tuple(stride))


def check(entries, layouts, where, absent_kinds=("attribute",), complete=True):
    """Checks each of the module's tensors against the arena's manifest: its name is there,
    with the same dtype, shape and strides (a parameter or buffer of a module built on the
    meta device has the strides its engine will bind; an attribute the engine's own
    post-processing made, those it computes with). When `entries` are the `complete` module,
    returns the arena names it does not hold that were "made" by the building engine's
    post-processing or whose kind is in `absent_kinds` (set afterwards by bind_absent) and
    refuses the others. BindingError naming both sides of every mismatch."""
    seen, missing, wrong = set(), [], []
    for entry in entries:
        if entry.arena_name in seen:
            continue
        seen.add(entry.arena_name)
        layout = layouts.get(entry.arena_name)
        if layout is None:
            missing.append("%s (%s)" % (entry.name, entry.kind))
            continue
        t = entry.tensor
        mine = (dtype_name(t.dtype), list(t.shape), list(t.stride()))
        theirs = (layout["dtype"], list(layout["shape"]), list(layout["stride"]))
        if mine != theirs or layout["kind"] not in (None, entry.kind):
            wrong.append("%s: arena %s, module %s" % (
                entry.name, _describe(layout["kind"], *theirs),
                _describe(entry.kind, *mine)))
    absent = [n for n in layouts if n not in seen and n != MANIFEST] if complete else []
    unexpected = [n for n in absent
                  if not layouts[n].get("made") and layouts[n]["kind"] not in absent_kinds]
    if missing or unexpected or wrong:
        raise BindingError(
            "%s does not match the arena: missing from the arena %s; not in the module %s; "
            "mismatched %s" % (where, missing[:8], unexpected[:8], wrong[:8]))
    return absent


def view(arena, name, layout):
    """The arena's read-only view of `name` with the layout the manifest records (its
    dimensions permuted back where it was published in storage order)."""
    base = arena.torch(name)
    order = layout.get("order") or list(range(base.dim()))
    if order == sorted(order):
        return base
    inverse = [order.index(d) for d in range(len(order))]
    out = base.permute(inverse).as_subclass(type(base))
    out._ea = base._ea
    return out


def bind(module, arena, entries, layouts, make_view=None, make_parameter=None):
    """Makes each entry's tensor the arena's view of its arena name: a Parameter of it for a
    parameter (tied names share one again), the view itself for a buffer or an attribute.
    `make_view(arena_name, kind, view)` may give another tensor for the view (a device copy);
    `make_parameter(arena_name, parameter)` may mark the parameters it makes. Returns
    {arena name: view}."""
    import torch
    views, params, replaced = {}, {}, {}
    for entry in entries:
        arena_name = entry.arena_name
        v = views.get(arena_name)
        if v is None:
            v = view(arena, arena_name, layouts[arena_name])
            if make_view is not None:
                v = make_view(arena_name, entry.kind, v)
            views[arena_name] = v
        owner, leaf = _owner(module, entry.name)
        if entry.kind == "parameter":
            param = params.get(arena_name)
            if param is None:
                param = params[arena_name] = torch.nn.Parameter(v, requires_grad=False)
                if make_parameter is not None:
                    make_parameter(arena_name, param)
            owner._parameters[leaf] = param
            replaced[id(entry.tensor)] = (entry.tensor, param)
        elif entry.kind == "buffer":
            owner._buffers[leaf] = v
            replaced[id(entry.tensor)] = (entry.tensor, v)
        else:
            # Not nn.Module.__setattr__: a plain tensor attribute stays one.
            object.__setattr__(owner, leaf, v)
            replaced[id(entry.tensor)] = (entry.tensor, v)
    retarget(module, replaced)
    return views


def retarget(module, replaced, depth=3):
    """Points the references that the module's helper objects hold to a tensor that was
    replaced (`replaced`: id -> (old, new)) at the new one: a layer's router or kernel object
    that kept its parameter at construction (vLLM's CPU MoE router keeps
    `e_score_correction_bias`) would otherwise compute on the meta tensor, or on the builder's
    private copy. Walks the objects (not modules, not tensors) reachable from the modules'
    attributes through attributes, lists, tuples and dicts, `depth` levels down."""
    import torch
    if not replaced:
        return
    seen = set()

    def new_of(x):
        hit = replaced.get(id(x)) if isinstance(x, torch.Tensor) else None
        return hit[1] if hit is not None and hit[0] is x else None

    def walk(obj, level):
        if level > depth or id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module)):
            return
        seen.add(id(obj))
        if isinstance(obj, (list, dict)):
            items = list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj))
            for key, x in items:
                new = new_of(x)
                if new is not None:
                    obj[key] = new
                else:
                    walk(x, level + 1)
            return
        if isinstance(obj, tuple):
            for x in obj:
                walk(x, level + 1)
            return
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict) or isinstance(obj, type):
            return
        for key, x in list(attrs.items()):
            new = new_of(x)
            if new is not None:
                attrs[key] = new
            else:
                walk(x, level + 1)

    for sub in module.modules():
        for key, x in list(vars(sub).items()):
            if key.startswith("_") and key in ("_parameters", "_buffers", "_modules"):
                continue
            if not isinstance(x, (torch.Tensor, torch.nn.Module)):
                walk(x, 1)


def _owner(module, name):
    """The module, or a module's helper object (`module.attribute`), that holds `name`'s leaf;
    None when there is none."""
    owner_name, _, leaf = name.rpartition(".")
    try:
        return (module.get_submodule(owner_name) if owner_name else module), leaf
    except AttributeError:
        pass
    holder_name, _, attribute = owner_name.rpartition(".")
    try:
        holder = module.get_submodule(holder_name) if holder_name else module
    except AttributeError:
        return None, leaf
    helper = vars(holder).get(attribute)
    return (helper if _is_helper(helper) else None), leaf


def _helpers(module):
    """[(name, helper)] of the helper objects `module`'s submodules keep (`_is_helper`)."""
    out = []
    for prefix, sub in module.named_modules():
        head = prefix + "." if prefix else ""
        out.extend((head + key, obj) for key, obj in vars(sub).items() if _is_helper(obj))
    return out


def derived_by_helpers(module):
    """Names of the submodules whose weights a helper with tensors of its own derived them
    from (the submodules it keeps: AMX MLA's impl keeps kv_b_proj, whose weight vLLM then
    empties): those tensors are published, so the emptied weight may be."""
    import torch
    names = collections.defaultdict(set)
    for n, m in module.named_modules(remove_duplicate=False):
        names[id(m)].add(n)
    out = set()
    for _, helper in _helpers(module):
        attrs = vars(helper)
        if any(isinstance(t, torch.Tensor) and t.numel() > 0 for t in attrs.values()):
            for m in attrs.values():
                if isinstance(m, torch.nn.Module):
                    out.update(names.get(id(m), ()))
    return out


@contextlib.contextmanager
def helpers_made_from_arena(module, layouts):
    """Inside it, a helper whose post-processing made tensors that the arena holds (the
    manifest's "made" names under `helper name.`) does not run its post-processing: it would
    derive them again from weights the building engine's emptied (AMX MLA's W_UK and W_UV from
    kv_b_proj); they are bound from the arena after it. Other helpers run theirs."""
    made = [n for n, layout in layouts.items() if layout.get("made")]
    skipped = [helper for name, helper in _helpers(module)
               if any(n.startswith(name + ".") for n in made)]
    for helper in skipped:
        object.__setattr__(helper, "process_weights_after_loading", lambda *a, **k: None)
    try:
        yield
    finally:
        for helper in skipped:
            vars(helper).pop("process_weights_after_loading", None)


def constructed_layouts(module):
    """{name: {dtype, shape, stride}} of what `module` holds before its post-processing, for
    declare()."""
    return {e.name: {"dtype": dtype_name(e.tensor.dtype), "shape": list(e.tensor.shape),
                     "stride": list(e.tensor.stride())} for e in module_tensors(module)}


def take_processed(module, layouts):
    """Gives each parameter or buffer of `module` (built on the meta device) that the building
    engine's post-processing gave another layout (the manifest's "constructed" is the layout it
    was built with, which this one still has) the arena's layout, so that it binds the arena's
    tensor; the post-processing that runs again on it sees what the builder's left."""
    import torch
    for entry in module_tensors(module):
        layout = layouts.get(entry.arena_name)
        before = layout.get("constructed") if layout else None
        t = entry.tensor
        if before is None or entry.kind == "attribute" or not t.is_meta or \
                [dtype_name(t.dtype), list(t.shape), list(t.stride())] != \
                [before.get(k) for k in ("dtype", "shape", "stride")]:
            continue
        t.data = torch.empty_strided(layout["shape"], layout["stride"], device="meta",
                                     dtype=torch_dtype_of(layout["dtype"]))


def unbind_made(module, layouts):
    """Takes out of `module` what the building engine's post-processing made (the manifest's
    "made" names, under each of their names), so that the module is what a freshly built one
    is and its post-processing can run again; what it remakes is bound afterwards."""
    import torch
    made = {n for n, layout in layouts.items() if layout.get("made")}
    for entry in module_tensors(module):
        if entry.arena_name in made:
            owner, leaf = _owner(module, entry.name)
            if not isinstance(owner, torch.nn.Module):
                # A helper's: None, as it was made (its post-processing sets it).
                object.__setattr__(owner, leaf, None)
            elif entry.kind == "parameter":
                del owner._parameters[leaf]
            elif entry.kind == "buffer":
                del owner._buffers[leaf]
            else:
                delattr(owner, leaf)


def bind_absent(module, arena, names, layouts, where, make_view=None):
    """Sets what the building engine's module held that this one does not (its
    post-processing, run on weights that are already processed, skips making it) to the
    arena's views, under every name it had and as the kind it was. BindingError when the
    module it belongs to is not there, or holds something else under that name. Returns
    {arena name: view}."""
    import torch
    views = {}
    for name in names:
        layout = layouts[name]
        v = view(arena, name, layout)
        if make_view is not None:
            v = make_view(name, layout["kind"], v)
        param = torch.nn.Parameter(v, requires_grad=False) \
            if layout["kind"] == "parameter" else None
        for full in [name] + list(layout.get("aliases", ())):
            owner, leaf = _owner(module, full)
            if owner is None or (isinstance(owner, torch.nn.Module) and (
                    leaf in owner._parameters or leaf in owner._buffers or
                    leaf in owner._modules)) or (
                    not isinstance(owner, torch.nn.Module) and layout["kind"] != "attribute"):
                raise BindingError(
                    "%s does not match the arena: the arena's %s has no place in the module"
                    % (where, full + " (" + _describe(layout["kind"], layout["dtype"],
                                                      layout["shape"], layout["stride"]) + ")"))
            if param is not None:
                owner._parameters[leaf] = param
            elif layout["kind"] == "buffer":
                owner._buffers[leaf] = v
            else:
                object.__setattr__(owner, leaf, v)
        views[name] = v
    return views


def bind_module(module, arena, where):
    """shared_module's binding: checks everything `module` holds against the arena and binds
    it, attributes the module lacks included; BindingError naming both sides otherwise."""
    where = "%s (arena %s)" % (where, arena.report["path"])
    layouts = manifest(arena)
    entries = module_tensors(module)
    absent = check(entries, layouts, where)
    views = bind(module, arena, entries, layouts)
    views.update(bind_absent(module, arena, absent, layouts, where))
    return views
