"""`import lingvo_pipe` alone makes our TFDS builders known, lazily.

Each case runs in a fresh interpreter: the test process has imported TFDS
and our builders long ago.
"""

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
  result = subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                          capture_output=True, text=True, check=False,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_import_lingvo_pipe_imports_neither_tensorflow_nor_tfds():
  out = _run("""
      import sys
      import lingvo_pipe
      print(sorted(m for m in ('tensorflow', 'tensorflow_datasets', 'numpy',
                               'lingvo_pipe.tasks') if m in sys.modules))
      print(lingvo_pipe.__version__)
      """)
  assert out.splitlines()[0] == '[]'
  assert out.splitlines()[1][0].isdigit()


def test_tfds_builder_knows_our_builders_after_import_lingvo_pipe(tmp_path):
  out = _run(f"""
      import lingvo_pipe
      import tensorflow_datasets as tfds
      for name in ('lingvo_pipe_fashion_mnist', 'lingvo_pipe_bible_en_es'):
        b = tfds.builder(name, data_dir={str(tmp_path)!r})
        print(type(b).__name__, b.MANUAL_DOWNLOAD_INSTRUCTIONS is not None)
      import importlib.resources  # TFDS's own resources still load.
      print(importlib.resources.files('tensorflow_datasets').is_dir())
      """)
  assert out.split() == ['LingvoPipeFashionMnist', 'True',
                         'LingvoPipeBibleEnEs', 'True', 'True']


def test_import_after_tfds_registers_at_once(tmp_path):
  out = _run(f"""
      import sys
      import tensorflow_datasets as tfds
      import lingvo_pipe
      print(tfds.builder('lingvo_pipe_fashion_mnist',
                         data_dir={str(tmp_path)!r}).name)
      print(any('TfdsFinder' in type(f).__name__ for f in sys.meta_path))
      """)
  assert out.split() == ['lingvo_pipe_fashion_mnist', 'False']
