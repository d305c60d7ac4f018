"""The generated kernel translation units (csrc/instantiations) are exactly what generate.py writes.

setup.py and `make prebuild` name these files from the same (direction, head dim, dtype, mask, score transform,
sequence layout) product; a file that is missing or stale would fail a GPU build (an unresolved launch template) or
link a kernel the dispatcher does not expect, so this CPU test catches it first.
"""
import importlib.util
import itertools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTANTIATIONS = ROOT / "csrc" / "instantiations"


def _generator():
    spec = importlib.util.spec_from_file_location("generate_instantiations", INSTANTIATIONS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_instantiation_file_is_generated_and_current():
    gen = _generator()
    expected = {}
    for direction, hdim, dtype, mask, mod in itertools.product(gen.DIRECTIONS, gen.HDIMS, gen.DTYPES, gen.MASKS,
                                                               gen.SCORE_MODS):
        header, func, params, extra = gen.DIRECTIONS[direction]
        fields = dict(header=header, func=func, hdim=hdim, elem=gen.DTYPES[dtype], mask=gen.MASKS[mask],
                      score_mod=gen.SCORE_MODS[mod], params=params, extra=extra)
        expected[gen.file_name(direction, hdim, dtype, mask, mod)] = gen.TEMPLATE.format(**fields)
        expected[gen.packed_file_name(direction, hdim, dtype, mask, mod)] = gen.PACKED_TEMPLATE.format(**fields)
    actual = {path.name: path.read_text() for path in INSTANTIATIONS.glob("*.cu")}
    assert sorted(actual) == sorted(expected)
    stale = [name for name in expected if actual[name] != expected[name]]
    assert not stale, f"run csrc/instantiations/generate.py: stale {stale}"

