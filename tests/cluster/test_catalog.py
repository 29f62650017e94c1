"""The device catalog holds every GPU the issues name, each figure with a source."""

from importlib import resources

import pytest
import yaml

from potluck.cluster.catalog import SOURCE_GROUPS, LinkKind, catalog, source_of

REQUIRED = [
    "cpu", "rtx3090", "rtx3090ti", "rtx4090", "rtx5090", "a100-40g-pcie", "a100-80g-pcie",
    "a100-80g-sxm", "h100-pcie", "h100-sxm", "v100-16g", "v100-32g", "t4", "a10", "l4", "l40s",
    "rtx-a6000", "mi250", "mi300x",
    # added for issue 10
    "rtx2080", "rtx2080ti", "titan-rtx", "rtx3060", "rtx3080", "rtx3080ti", "rtx4070ti",
    "rtx4080", "rtx-a5000", "rtx-6000-ada", "l40", "a40", "h200", "gh200", "b200", "mi210",
]
# No TF32 path: before Ampere (Volta, Turing), the CPU, and AMD CDNA 2.
WITHOUT_TF32 = {"cpu", "rtx2080", "rtx2080ti", "titan-rtx", "t4", "v100-16g", "v100-32g",
                "mi210", "mi250"}
TURING = {"rtx2080", "rtx2080ti", "titan-rtx", "t4"}
# GeForce Ampere/Ada/Blackwell: FP16 tensor with FP32 accumulate runs at half the FP16-accumulate
# rate, which makes it exactly twice the CUDA-core FP32 rate (GA102/AD102 whitepapers).
GEFORCE_HALF_RATE = {"rtx3060", "rtx3080", "rtx3080ti", "rtx3090", "rtx3090ti", "rtx4070ti",
                     "rtx4080", "rtx4090", "rtx5090"}


def raw_entries() -> dict:
    text = resources.files("potluck.cluster").joinpath("catalog.yaml").read_text()
    return yaml.safe_load(text)


def test_every_required_device_is_in_the_catalog():
    assert set(REQUIRED) <= set(catalog())


@pytest.mark.parametrize("name", REQUIRED)
def test_each_entry_has_figures_and_sources(name):
    device = catalog()[name]
    assert device.tflops > 0 and device.memory_bytes > 0
    assert device.memory_bandwidth_bytes_per_s > 0
    # the GEMM ceiling: GeForce cards measure up to 1.14 of the peak they are rated at (they run
    # above its boost clock: potluck.planner.gemm); the others below 1
    assert 0 < device.matmul_efficiency <= 1.2
    assert device.price_per_hour_usd > 0 and device.purchase_price_usd > 0
    assert device.spot_price_per_hour_usd > 0, "`potluck cost --spot` needs a spot price for every type"
    assert device.power_w > 0
    assert device.sources, f"{name} has no sources"


@pytest.mark.parametrize("name", sorted(raw_entries()))
def test_every_field_of_an_entry_has_a_source(name):
    """A field's own key covers it, else its group (`specs`, `price`), else `all`."""
    raw = raw_entries()[name]
    device = catalog()[name]
    missing = [key for key in raw if key != "sources" and not source_of(device, key)]
    assert not missing, f"{name}: no source for {missing}"
    known = set(raw) | set(SOURCE_GROUPS) | {"all"}
    assert set(raw["sources"]) <= known, f"{name}: sources for fields it does not have"


def test_a_fields_own_source_wins_over_its_group():
    device = catalog()["a100-80g-pcie"]
    assert source_of(device, "memory_bandwidth") == "NVIDIA A100 datasheet (80GB PCIe)"
    assert source_of(device, "memory").startswith("NVIDIA A100 datasheet (GA100")
    assert "RunPod" in source_of(device, "spot_price_per_hour")
    assert source_of(catalog()["cpu"], "tflops").startswith("nominal figures")


@pytest.mark.parametrize("name", sorted(catalog()))
def test_peaks_are_consistent(name):
    device = catalog()[name]
    assert device.fp32_tflops > 0
    assert device.fp32_tflops <= device.tflops
    assert device.tf32_tflops <= device.tflops
    assert device.memory_bytes > 0
    assert (device.tf32_tflops > 0) == (name not in WITHOUT_TF32)


@pytest.mark.parametrize("name", sorted(set(catalog()) - WITHOUT_TF32))
def test_tf32_runs_at_half_the_16_bit_tensor_rate(name):
    """True of every TF32-capable part (A100: 156 vs 312; 3090: 35.6 vs 71; MI300X: 653.7 vs 1307);
    a GeForce figure taken with FP16 accumulate would break it. B200's datasheet rounds (1.1 vs 2.25)."""
    device = catalog()[name]
    assert device.tf32_tflops == pytest.approx(device.tflops / 2, rel=0.03)


@pytest.mark.parametrize("name", sorted(GEFORCE_HALF_RATE))
def test_geforce_16_bit_figure_is_the_fp32_accumulate_one(name):
    device = catalog()[name]
    assert device.tflops == pytest.approx(2 * device.fp32_tflops, rel=0.01)


def test_turing_has_no_bf16_and_no_tf32():
    for name in TURING:
        assert not catalog()[name].bf16 and catalog()[name].tf32_tflops == 0
    # GeForce Turing halves FP32 accumulate (4x FP32 cores); Titan RTX does not (8x).
    assert catalog()["rtx2080ti"].tflops == pytest.approx(4 * catalog()["rtx2080ti"].fp32_tflops, rel=0.01)
    assert catalog()["titan-rtx"].tflops == pytest.approx(8 * catalog()["titan-rtx"].fp32_tflops, rel=0.01)


@pytest.mark.parametrize(
    ("name", "tflops", "memory_gb"),
    [("rtx3090", 71, 24), ("rtx4090", 165.2, 24), ("a100-80g-sxm", 312, 80),
     ("h100-sxm", 989, 80), ("t4", 65, 16), ("l40s", 362, 48), ("mi300x", 1307, 192),
     ("rtx3080", 59.5, 10), ("titan-rtx", 130.5, 24), ("l40", 181.05, 48), ("a40", 149.7, 48),
     ("h200", 989, 141), ("b200", 2250, 180), ("mi210", 181, 64)],
)
def test_figures_match_the_reference_sheet(name, tflops, memory_gb):
    device = catalog()[name]
    assert device.tflops == pytest.approx(tflops)
    assert device.memory_bytes == pytest.approx(memory_gb * 1e9)


def test_fp32_and_tf32_match_the_datasheets():
    a100 = catalog()["a100-80g-sxm"]
    assert (a100.fp32_tflops, a100.tf32_tflops) == (19.5, 156)
    assert (catalog()["mi300x"].fp32_tflops, catalog()["mi300x"].tf32_tflops) == (81.7, 653.7)
    assert catalog()["mi250"].fp32_tflops == 45.3  # FP32 vector, not the 90.5 matrix figure


def test_links_and_bf16():
    assert catalog()["rtx3090"].link is LinkKind.NVLINK_BRIDGE
    assert catalog()["rtx4090"].link is LinkKind.NONE
    assert catalog()["a100-80g-sxm"].link is LinkKind.NVLINK
    assert catalog()["b200"].link is LinkKind.NVLINK
    assert not catalog()["v100-32g"].bf16 and not catalog()["t4"].bf16
    assert catalog()["a100-80g-sxm"].bf16


def test_raw_compute_per_dollar_ranks_the_4090_above_the_a100():
    """The seed talk's RCC observation follows from the catalog prices."""
    def rcc(name: str) -> float:
        return catalog()[name].tflops / catalog()[name].price_per_hour_usd

    assert rcc("rtx4090") > rcc("a100-80g-sxm")
