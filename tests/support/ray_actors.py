"""Ray actor classes for the Ray executor's tests (no tests here): importable by the actors'
worker processes, which load an actor's class by its module path."""
from __future__ import annotations

import dataclasses
import json

from tandem.engine.ranks.ray_worker import TensorParallelRank

MISSING_MODEL = "/nonexistent/model"


class RankWithoutTheModel(TensorParallelRank):
    """A rank on a node that lacks the model directory: it joins the group, then its build fails."""

    def run(self, launch) -> None:
        fields = json.loads(launch.config_json)
        fields["model"] = MISSING_MODEL
        return super().run(dataclasses.replace(launch, config_json=json.dumps(fields).encode()))
