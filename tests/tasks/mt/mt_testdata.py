"""Short hand-written verse-like pairs for the translation tests (no file of
the prepared data is read); imported by conftest.py and the tests alike."""

from __future__ import annotations

import pathlib

PAIRS = [
    ('In the beginning was the word.', 'En el principio era el verbo.'),
    ('And the earth was without form.', 'Y la tierra estaba desordenada.'),
    ('And God said, let there be light.', 'Y dijo Dios: Sea la luz.'),
    ('And there was light.', 'Y fué la luz.'),
    ('The LORD is my shepherd.', 'Jehová es mi pastor.'),
    ('I shall not want.', 'Nada me faltará.'),
    ('Blessed are the meek.', 'Bienaventurados los mansos.'),
    ('For they shall inherit the earth.', 'Porque ellos recibirán la '
     'tierra.'),
    ('Love your enemies.', 'Amad á vuestros enemigos.'),
    ('Grace be with you all. Amen.', 'La gracia sea con todos vosotros. '
     'Amén.'),
    ('And the men of the city said unto him.', 'Y los de la ciudad le '
     'dijeron.'),
    ('And the LORD spake unto Moses.', 'Y Jehová habló á Moisés.'),
    ('For God so loved the world.', 'Porque de tal manera amó Dios al '
     'mundo.'),
    ('The grace of our Lord be with you.', 'La gracia de nuestro Señor sea '
     'con vosotros.'),
    ('Now it came to pass in those days.', 'Y aconteció en aquellos días.'),
    ('And he went down to the city.', 'Y descendió á la ciudad.'),
    ('The heaven and the earth shall pass away.', 'El cielo y la tierra '
     'pasarán.'),
    ('But my words shall not pass away.', 'Mas mis palabras no pasarán.'),
    ('Ask, and it shall be given you.', 'Pedid, y se os dará.'),
    ('Seek, and ye shall find.', 'Buscad, y hallaréis.'),
    ('Knock, and it shall be opened unto you.', 'Llamad, y se os abrirá.'),
    ('Jesus wept.', 'Y lloró Jesús.'),
    ('Rejoice evermore.', 'Estad siempre gozosos.'),
    ('Pray without ceasing.', 'Orad sin cesar.'),
]
# One pair far longer than the others: dropped in training, cut in eval.
LONG_PAIR = (' '.join(['and the people of the city went out'] * 6) + '.',
             ' '.join(['y el pueblo de la ciudad salió'] * 6) + '.')


def write_tsv(path: pathlib.Path, pairs) -> pathlib.Path:
  path.write_text(''.join(f'{en}\t{es}\n' for en, es in pairs),
                  encoding='utf-8')
  return path
