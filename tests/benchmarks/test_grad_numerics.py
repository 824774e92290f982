"""``benchmarks/grad_numerics.py``: the gradient error of each scheme, at a tiny size."""

import json

from benchmarks import grad_numerics


def test_rows_of_every_scheme_and_format(tmp_path, capsys):
  results = tmp_path / "grad.jsonl"
  argv = ["--shape", "16", "32", "16", "--keys", "16", "--chunk", "8", "--results", str(results)]
  assert grad_numerics.main(argv) == 0
  rows = [json.loads(line) for line in results.read_text().splitlines()]
  value = {(r["case"].split()[-1], r["scheme"], r["metric"]): r for r in rows}
  schemes = {
    "int8": {"folded", "requantized", "saturating", "forward_only"},
    "fp8": {"folded", "requantized", "forward_only"},
  }
  for fmt, names in schemes.items():
    assert {s for f, s, _ in value if f == fmt} == names
    for name in names:
      assert (
        value[(fmt, name, "dW_mean_err")]["baseline"] == value[(fmt, "requantized", "dW_mean_err")]["value"]
      )
      assert value[(fmt, name, "dW_single_err")]["value"] > 0
    assert value[(fmt, "forward_only", "dX_mean_bias")]["value"] == 0.0
    # the re-quantized scheme's second rounding is a bias; the folded one's is noise / 4
    for leg in ("dX", "dW"):
      folded = value[(fmt, "folded", f"{leg}_mean_bias")]["value"]
      assert 0 < folded < value[(fmt, "requantized", f"{leg}_mean_bias")]["value"]
  assert value[("int8", "folded", "dW_single_err")]["keys"] == 16
  assert "saturating" in capsys.readouterr().out
