"""``strategy``: run a test once per unmerged injection strategy (``lora.unmerged.STRATEGIES``), selected the way a
user would, through ``$LEANDIFFUSION_LORA_STRATEGY`` (``inject_lora(strategy="auto")`` reads it)."""
import pytest

from leandiffusion.lora.unmerged import ENV_STRATEGY, STRATEGIES


@pytest.fixture(params=STRATEGIES)
def strategy(request, monkeypatch):
    monkeypatch.setenv(ENV_STRATEGY, request.param)
    return request.param
