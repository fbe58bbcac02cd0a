"""Bad input ends with one clear line on stderr, exit 2, logdir untouched."""

import pytest

import binary_runner as br
from lingvo_pipe.core import model_registry

_TYPO = 'synthetic.regresion.MlpRegression'

# (case, binary, args, what the one line must contain). {fresh}: a logdir
# path that does not exist; {eval}: a logdir holding only a params.txt;
# {file}: a regular file.
_CASES = [
    ('unknown_model', 'trainer', [f'--model={_TYPO}', '--logdir={fresh}'],
     f'Closest: {br.MODEL}'),
    ('malformed_override', 'trainer',
     [f'--model={br.MODEL}', '--logdir={fresh}',
      '--model_params_override=task.train.learning_rate 0.1'],
     'Malformed params line'),
    ('undefined_param', 'trainer',
     [f'--model={br.MODEL}', '--logdir={fresh}',
      '--model_params_override=task.train.learning_rat: 0.1'],
     "Did you mean 'learning_rate'"),
    ('missing_override_file', 'trainer',
     [f'--model={br.MODEL}', '--logdir={fresh}',
      '--model_params_file_override={fresh}.txt'],
     'Cannot read --model_params_file_override'),
    ('logdir_not_writable', 'trainer',
     [f'--model={br.MODEL}', '--logdir={file}/logdir'], 'is not writable'),
    ('negative_minutes', 'trainer',
     [f'--model={br.MODEL}', '--logdir={fresh}', '--max_train_minutes=-1'],
     '--max_train_minutes=-1 is negative'),
    ('malformed_flag', 'trainer',
     [f'--model={br.MODEL}', '--logdir={fresh}', '--max_steps=ten'],
     "flag --max_steps=ten: invalid literal"),
    ('unknown_flag', 'trainer',
     [f'--model={br.MODEL}', '--logdir={fresh}', '--max_step=10'],
     "Unknown command line flag 'max_step'"),
    ('no_data', 'trainer',
     [f'--model={br.MODEL}', '--logdir={fresh}',
      '--model_params_override=input.npz_path: /no/such/data.npz'],
     'data not available'),
    ('eval_unknown_model', 'evaler', ['--logdir={typo}'],
     f'Closest: {br.MODEL}'),
    ('eval_malformed_override', 'evaler',
     ['--logdir={eval}', '--model_params_override=input.batch_size = 3'],
     'Malformed params line'),
    ('eval_undefined_param', 'evaler',
     ['--logdir={eval}', '--model_params_override=input.batch_sise: 3'],
     "Did you mean 'batch_size'"),
    ('eval_bad_enum', 'evaler', ['--logdir={eval}', '--mode=once'],
     'value should be one of <latest|all|continuous>'),
    ('eval_not_a_logdir', 'evaler', ['--logdir={fresh}'],
     'run the trainer first'),
    ('eval_logdir_not_writable', 'evaler', ['--logdir={file}/logdir'],
     'is not writable'),
    ('eval_no_data', 'evaler',
     ['--logdir={eval}',
      '--model_params_override=input.npz_path: /no/such/data.npz'],
     'data not available'),
]


@pytest.fixture(scope='module')
def bad_runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('bad')
  file = tmp / 'a_file'
  file.write_text('not a directory')
  dirs = {}
  for name, model in (('eval', br.MODEL), ('typo', _TYPO)):
    dirs[name] = tmp / name
    dirs[name].mkdir()
    text = model_registry.get_params(br.MODEL, 'Train').ToText()
    (dirs[name] / 'params.txt').write_text(
        text.replace(f"model : '{br.MODEL}'", f"model : '{model}'"))
  before = {name: br.tree(d) for name, d in dirs.items()}
  runs = []
  for case, binary, args, _ in _CASES:
    fields = dict(fresh=tmp / case, file=file, **dirs)
    runs.append((binary, [a.format(**fields) for a in args]))
  results = dict(zip([c[0] for c in _CASES], br.run_many(runs)))
  return results, tmp, dirs, before


@pytest.mark.parametrize('case, binary, expected',
                         [(c[0], c[1], c[3]) for c in _CASES],
                         ids=[c[0] for c in _CASES])
def test_one_line_exit_2_nothing_written(bad_runs, case, binary, expected):
  results, tmp, dirs, before = bad_runs
  rc, out, err = results[case]
  lines = err.strip().splitlines()
  assert rc == 2, err
  assert len(lines) == 1, err
  assert lines[0].startswith(f'{binary}: error: ')
  assert expected in lines[0]
  assert not out
  assert not (tmp / case).exists()
  assert {name: br.tree(d) for name, d in dirs.items()} == before
