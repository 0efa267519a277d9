"""Key mapping on the real SD1.5 / SDXL UNet layouts (built on the meta device: no weights, no hub).

The expected pairs are LDM <-> diffusers module names as they appear in real kohya SD1.5 / SDXL LoRA files and
in diffusers' own single-file converter; they are written out by hand here, not derived by the code under test.
"""
import pytest
import torch

from leandiffusion.bench.models import SD15_UNET, SDXL_UNET
from leandiffusion.lora.formats import LoraLayer
from leandiffusion.lora.keymap import ModuleIndex, ldm_unet_names


@pytest.fixture(scope="module")
def unets():
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return {"sd15": UNet2DConditionModel(**SD15_UNET), "sdxl": UNet2DConditionModel(**SDXL_UNET)}


SDXL_PAIRS = {
    "input_blocks.0.0": "conv_in",
    "input_blocks.1.0.in_layers.2": "down_blocks.0.resnets.0.conv1",
    "input_blocks.3.0.op": "down_blocks.0.downsamplers.0.conv",
    "input_blocks.4.0.skip_connection": "down_blocks.1.resnets.0.conv_shortcut",
    "input_blocks.4.1.transformer_blocks.0.attn1.to_q": "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
    "input_blocks.5.1.proj_in": "down_blocks.1.attentions.1.proj_in",
    "input_blocks.6.0.op": "down_blocks.1.downsamplers.0.conv",
    "input_blocks.8.1.transformer_blocks.9.ff.net.2": "down_blocks.2.attentions.1.transformer_blocks.9.ff.net.2",
    "middle_block.0.emb_layers.1": "mid_block.resnets.0.time_emb_proj",
    "middle_block.1.transformer_blocks.9.attn2.to_k": "mid_block.attentions.0.transformer_blocks.9.attn2.to_k",
    "middle_block.2.out_layers.3": "mid_block.resnets.1.conv2",
    "output_blocks.0.1.transformer_blocks.0.attn1.to_out.0":
        "up_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0",
    "output_blocks.2.2.conv": "up_blocks.0.upsamplers.0.conv",
    "output_blocks.5.2.conv": "up_blocks.1.upsamplers.0.conv",
    "output_blocks.5.1.proj_out": "up_blocks.1.attentions.2.proj_out",
    "output_blocks.8.0.skip_connection": "up_blocks.2.resnets.2.conv_shortcut",
    "time_embed.0": "time_embedding.linear_1",
    "label_emb.0.2": "add_embedding.linear_2",
    "out.2": "conv_out",
}
SD15_PAIRS = {
    "input_blocks.1.1.proj_in": "down_blocks.0.attentions.0.proj_in",
    "input_blocks.3.0.op": "down_blocks.0.downsamplers.0.conv",
    "input_blocks.11.0.out_layers.3": "down_blocks.3.resnets.1.conv2",
    "middle_block.1.transformer_blocks.0.ff.net.0.proj": "mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj",
    "output_blocks.2.1.conv": "up_blocks.0.upsamplers.0.conv",
    "output_blocks.5.2.conv": "up_blocks.1.upsamplers.0.conv",
    "output_blocks.11.1.transformer_blocks.0.attn1.to_q": "up_blocks.3.attentions.2.transformer_blocks.0.attn1.to_q",
}


@pytest.mark.parametrize("kind,pairs", [("sdxl", SDXL_PAIRS), ("sd15", SD15_PAIRS)])
def test_ldm_names_of_real_layouts(unets, kind, pairs):
    names = ldm_unet_names(unets[kind])
    inverse = {ldm: d for d, ldm in names.items()}
    for ldm, diffusers_name in pairs.items():
        assert inverse.get(ldm) == diffusers_name, ldm
    assert len(inverse) == len(names)  # one LDM name per module


def test_kohya_lookup_both_spellings(unets):
    index = ModuleIndex("unet", unets["sdxl"])
    empty = torch.zeros(1, 1)

    def find(name):
        return index.lookup(LoraLayer("unet", name, "kohya", empty, empty, 1.0, name))

    assert find("input_blocks_4_1_transformer_blocks_0_attn1_to_q") == \
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    assert find("down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q") == \
        "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    assert find("output_blocks_2_2_conv") == "up_blocks.0.upsamplers.0.conv"
    assert find("input_blocks_4_1_transformer_blocks_0_attn1_to_z") is None


def test_an_ambiguous_kohya_spelling_is_refused_not_guessed():
    """``a_b.c`` and ``a.b_c`` are both ``a_b_c`` in kohya's spelling: such a key names no module (the mapping
    refuses it, listing the key) rather than whichever module was indexed last; the dotted names stay exact."""
    from leandiffusion.lora.formats import ParsedLora
    from leandiffusion.lora.keymap import resolve

    root = torch.nn.Module()
    root.a_b, root.a = torch.nn.Module(), torch.nn.Module()
    root.a_b.c, root.a.b_c = torch.nn.Linear(2, 3), torch.nn.Linear(2, 3)

    def layer(name, naming):
        return LoraLayer("unet", name, naming, torch.zeros(1, 2), torch.zeros(3, 1), 1.0, f"lora_unet_{name}")

    index = ModuleIndex("unet", root)
    assert index.lookup(layer("a_b_c", "kohya")) is None
    assert index.lookup(layer("a_b.c", "dotted")) == "a_b.c" and index.lookup(layer("a.b_c", "dotted")) == "a.b_c"
    with pytest.raises(ValueError, match=r"1 of 1 layers match no module .*lora_unet_a_b_c"):
        resolve(ParsedLora("kohya", (layer("a_b_c", "kohya"),), "x.safetensors"), {"unet": root}, "sd1")


@pytest.mark.parametrize("down_shape,up_shape,problem", [
    ((1, 2), (4, 1), "maps 2->3 but the LoRA maps 2->4"),  # the output side alone is wrong
    ((1, 5), (3, 1), "maps 2->3 but the LoRA maps 5->3"),
])
def test_a_linear_lora_of_the_wrong_width_on_either_side_is_named(down_shape, up_shape, problem):
    """Both sides: a check that ignored the up factor's rows would let the mismatch fail later inside a forward,
    with torch's bare shape error."""
    from leandiffusion.lora.keymap import Target, shape_problem

    linear = torch.nn.Linear(2, 3)
    layer = LoraLayer("unet", "l", "kohya", torch.zeros(down_shape), torch.zeros(up_shape), 1.0, "lora_unet_l")
    assert problem in shape_problem(Target("unet", "l", linear, layer))
    fits = LoraLayer("unet", "l", "kohya", torch.zeros(1, 2), torch.zeros(3, 1), 1.0, "lora_unet_l")
    assert shape_problem(Target("unet", "l", linear, fits)) == ""
