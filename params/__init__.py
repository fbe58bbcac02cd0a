"""Registered model configs: `params/<domain>/<module>.py:<Class>`.

Each module here is short, defines no flags, and registers its models with
`@model_registry.RegisterSingleTaskModel`, under the name
`<domain>.<module>.<Class>` (e.g. `synthetic.regression.MlpRegression`).
"""
