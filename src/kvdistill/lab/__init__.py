"""The lab: what asks whether kvdistill works, apart from the library a user imports.

Generated tasks with per-token facts (`tasks/`), the evidence regimes' assets and shipped teachers
(`regimes`), the linear probe audit (`probe`), the projector A/B study (`projector_study`) and the
pre-registration of an ablation (`prereg`). Commands (`demo`, `ablate`, `probe`, `layout`, `gen-data`,
`ab-projector`) wire them; the library (cache, align, losses, data, models, teachers, capture, fusion,
evaluate, train) never imports them: an import-linter contract in pyproject.toml says so.
"""
