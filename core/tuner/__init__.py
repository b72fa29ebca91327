"""The loader tuner's decisions, pure and stdlib-only: rules (when to change what),
model (batches/s for n workers), persist (whether to keep a pool across epochs), judge
(a change kept or undone under the noise measured), types (what the trainer measures and
the tuner decides)."""
