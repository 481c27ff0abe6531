"""Quality experiments: drafter variants, acceptance spread, regeneration's effect on
acceptance, and the SpecForge comparison (specforge/)."""
