"""Bridges from other libraries to dash_attn's kernels.

Each bridge lives in its own submodule and imports its library only when used, so that `import dash_attn` (and this
package) never pulls in an optional dependency: `dash_attn.integrations.transformers.register()` adds
`attn_implementation="dash_attn"` to Hugging Face transformers.
"""
