"""The diarization evaluation set: seeded espeak-ng conversations of 2 to 5 speakers.

Each conversation draws its speakers from espeak-ng's English accents and voice variants, each
with its own pitch and rate; turns of 0.5 to 8 s (one short reply up to three sentences),
pauses of 0.1 to 1.2 s, and in some conversations a few turns that start before the previous
one ends (the two voices mixed); and monologues, one voice reading a few lines, where the
estimate must find one speaker. Everything is drawn from one `random.Random` per
conversation seeded by (SEED, index), so the set is the same on every run and a test can take
conversation 3 without building 0-2. Nothing is committed as audio: `build` renders a
conversation to a WAV file with the espeak-ng on the machine.

The speakers of one conversation never share a voice variant (the variant sets the voice's
timbre; accent, pitch and rate vary around it), as two people in one room are two voices.
Everyone speaks at least twice, the first time at least one full sentence, so each speaker
has a few seconds of speech to be found by (a participant who only ever says "okay" is not).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.conversation import SAMPLE_RATE, speak, write_mix

SEED = 25
COUNT = 24  # 6 each of 2, 3, 4 and 5 speakers
MONOLOGUES = 12  # beside them: one voice each (`monologue`)
SPEAKER_COUNTS = (2, 3, 4, 5)
ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan",
           "en-gb-x-gbcwmd", "en-029", "en-us-nyc")
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5",
            "adam", "Andy", "Annie", "aunty", "boris", "david", "edward", "john", "linda",
            "max", "Michael", "paul", "quincy", "robert", "steph", "zac")
#: espeak-ng's other human voice variants, none of which any threshold was measured on: the
#: bench's check of the count on voices nobody tuned for (`bench/diarization.py
#: --untuned-voices`). Left out: the robots, whispers and effects (robosoft*, UniRobot,
#: anikaRobot, RicishayMax*, whisper, whisperf, Demonic, announcer, fast_test) and "Mr
#: serious", whose file name has a space (`+Mr` is the default voice)
UNTUNED_VARIANTS = (
    "Alex", "Alicia", "Andrea", "antonio", "belinda", "benjamin", "caleb", "Denis", "Diogo",
    "ed", "edward2", "Gene", "Gene2", "gustave", "Henrique", "Hugo", "iven", "iven2", "iven3",
    "iven4", "Jacky", "kaukovalta", "Lee", "marcelo", "Marco", "Mario", "michel", "miguel",
    "Mike", "Nguyen", "pablo", "pedro", "rob", "steph2", "steph3", "Storm", "Tweaky",
    "anika", "AnxiousAndy", "grandpa", "klatt", "klatt2", "klatt3", "klatt4", "norbert",
    "sandro", "shelby", "travis", "victor", "m8", "croak", "grandma")
PITCH = (25, 75)  # espeak-ng -p (0-99, default 50)
RATE = (135, 195)  # espeak-ng -s, words per minute (default 175)
TURN_SECONDS = (0.5, 8.0)
PAUSE_SECONDS = (0.1, 1.2)
OVERLAP_SECONDS = (0.2, 0.7)
#: what counts as voice when a turn is trimmed of espeak's own silence
_SILENCE = 1e-3

SHORT = ("Yes, I agree.", "Right, of course.", "Okay then.", "No, not really.", "Sure thing.",
         "I see.", "Exactly right.", "Really? Are you sure?", "Thanks a lot.", "Fine by me.",
         "Not yet, sorry.", "That sounds good.")
SENTENCES = (
    "The train to the coast leaves at half past nine on weekdays.",
    "I think we should move the meeting to Thursday afternoon.",
    "Could you send me the figures from last quarter before lunch?",
    "The garden needs watering twice a week during the summer.",
    "She told me the new bridge will open early next spring.",
    "We ran out of coffee again, so someone has to buy more.",
    "My brother is learning to play the violin at the music school.",
    "The report is nearly finished, but the charts still need work.",
    "Please remember to lock the back door when you leave tonight.",
    "There was a long queue at the bakery this morning.",
    "The museum has a new exhibition about ancient maps and sailors.",
    "If the weather holds, we can walk along the river on Sunday.",
    "I left my umbrella on the bus and only noticed at home.",
    "The kitchen is being painted, so we are eating in the garden.",
    "Our neighbours adopted a small dog with very large ears.",
    "The library closes early on Fridays during the holidays.",
    "He fixed the old bicycle with parts from three different shops.",
    "We should book the tickets now, before the prices go up.",
    "The soup needs more salt, and perhaps a little pepper too.",
    "I have never seen so many stars as on that mountain night.",
    "The printer on the second floor has been broken all week.",
    "Let me check the calendar and call you back in ten minutes.",
    "They are building a new school next to the football field.",
    "Most of the apples this year came from the tree by the fence.",
    "The flight was delayed by two hours because of the fog.",
    "I would rather take the stairs than wait for that lift.",
    "The children made a cardboard castle in the living room.",
    "Can you remind me which platform the northern trains use?",
    "We planted tomatoes, beans and a row of sunflowers.",
    "The shop on the corner now sells fresh bread every morning.",
    "My phone battery dies by the middle of every afternoon.",
    "The orchestra rehearses in the old church on Tuesday evenings.",
    "It took us an hour to find a parking space near the market.",
    "The recipe calls for two eggs, a cup of flour and some milk.",
    "I am not sure the blue paint matches the curtains at all.",
    "The river flooded the lower fields after the heavy rain.",
)


@dataclass(frozen=True, slots=True)
class Voice:
    accent: str
    variant: str
    pitch: int
    rate: int

    @property
    def name(self) -> str:
        return f"{self.accent}+{self.variant} -p {self.pitch} -s {self.rate}"

    def say(self, text: str) -> np.ndarray:
        return speak(f"{self.accent}+{self.variant}", text, pitch=self.pitch, rate=self.rate)


@dataclass(frozen=True, slots=True)
class Line:
    speaker: int  # index into the conversation's voices
    text: str
    pause: float  # seconds of silence before it (negative: it starts that much early)


@dataclass(frozen=True, slots=True)
class Spec:
    """One conversation, before it is rendered."""

    index: int
    voices: tuple[Voice, ...]
    lines: tuple[Line, ...]


@dataclass(frozen=True, slots=True)
class RefTurn:
    start: float
    end: float
    speaker: str  # "S0", "S1", … by voice index
    text: str


@dataclass(frozen=True, slots=True)
class Conversation:
    spec: Spec
    path: Path
    turns: list[RefTurn]
    seconds: float

    @property
    def speakers(self) -> int:
        return len(self.spec.voices)


def spec(index: int, seed: int = SEED, variants: tuple[str, ...] = VARIANTS) -> Spec:
    """Conversation `index` of the set: speakers (of `variants`), lines, pauses; a pure
    function of the three."""
    rng = random.Random(f"diarization-set:{seed}:{index}")
    count = SPEAKER_COUNTS[index % len(SPEAKER_COUNTS)]
    voices = tuple(Voice(rng.choice(ACCENTS), variant, rng.randint(*PITCH), rng.randint(*RATE))
                   for variant in rng.sample(variants, count))
    overlaps = rng.random() < 0.4  # some conversations have a few overlapping turns
    # every speaker speaks at least twice; then a random walk with no one answering themself
    order = [s for s in range(count) for _ in range(2)]
    order += [rng.randrange(count) for _ in range(rng.randint(2, 6))]
    rng.shuffle(order)
    for position in range(1, len(order)):
        if order[position] == order[position - 1]:
            order[position] = (order[position] + rng.randint(1, count - 1)) % count
    lines = []
    spoken: set[int] = set()
    for position, speaker in enumerate(order):
        kind = rng.random()
        if speaker not in spoken:  # everyone's first turn is a full sentence at least
            kind = max(kind, 0.15)
            spoken.add(speaker)
        text = _line(rng, kind)
        pause = rng.uniform(*PAUSE_SECONDS)
        if position and overlaps and rng.random() < 0.25:
            pause = -rng.uniform(*OVERLAP_SECONDS)
        lines.append(Line(speaker, text, round(pause, 3)))
    return Spec(index, voices, tuple(lines))


def _line(rng: random.Random, kind: float) -> str:
    """A short reply (kind < 0.15), or one to three sentences."""
    if kind < 0.15:
        return rng.choice(SHORT)
    return " ".join(rng.sample(SENTENCES, 1 if kind < 0.6 else 2 if kind < 0.9 else 3))


def monologue(index: int, seed: int = SEED, variants: tuple[str, ...] = VARIANTS) -> Spec:
    """One voice reading 3 to 10 lines with pauses (a talk, a voice note), drawn as a
    conversation's speakers and lines are: the estimate must find one speaker in it."""
    rng = random.Random(f"diarization-set:monologue:{seed}:{index}")
    voice = Voice(rng.choice(ACCENTS), rng.choice(variants), rng.randint(*PITCH),
                  rng.randint(*RATE))
    lines = tuple(Line(0, _line(rng, rng.random()), round(rng.uniform(*PAUSE_SECONDS), 3))
                  for _ in range(rng.randint(3, 10)))
    return Spec(index, (voice,), lines)


def lengthened(item: Spec, lines: int, seed: int = SEED) -> Spec:
    """`item`'s voices speaking `lines` lines (a meeting, a lecture: 100 lines run ~8 minutes):
    everyone in turn at first, then at random, no one answering themself."""
    rng = random.Random(f"diarization-set:lengthened:{seed}:{item.index}:{len(item.voices)}")
    count = len(item.voices)
    drawn: list[Line] = []
    for position in range(lines):
        speaker = position % count if position < count else rng.randrange(count)
        if drawn and count > 1 and drawn[-1].speaker == speaker:
            speaker = (speaker + 1) % count
        drawn.append(Line(speaker, _line(rng, rng.random()),
                          round(rng.uniform(*PAUSE_SECONDS), 3)))
    return Spec(item.index, item.voices, tuple(drawn))


def _trimmed(audio: np.ndarray) -> np.ndarray:
    loud = np.flatnonzero(np.abs(audio) > _SILENCE)
    return audio[int(loud[0]):int(loud[-1]) + 1] if len(loud) else audio


def _turn_audio(voice: Voice, text: str) -> np.ndarray:
    """The line spoken, at most TURN_SECONDS[1]: sentences dropped from the end until it fits
    (the first sentence alone always does at these rates)."""
    sentences = text.split(". ")
    while True:
        audio = _trimmed(voice.say(". ".join(sentences)))
        if len(audio) <= TURN_SECONDS[1] * SAMPLE_RATE or len(sentences) == 1:
            return audio[:int(TURN_SECONDS[1] * SAMPLE_RATE)]
        sentences = sentences[:-1]


def render(item: Spec, path: Path) -> Conversation:
    """Write `item` to `path` (16 kHz WAV) with its reference turns."""
    pieces: list[tuple[int, np.ndarray]] = []
    turns: list[RefTurn] = []
    cursor = int(0.3 * SAMPLE_RATE)
    previous_end = cursor
    for line in item.lines:
        audio = _turn_audio(item.voices[line.speaker], line.text)
        start = previous_end + int(line.pause * SAMPLE_RATE)
        if turns:  # an overlap never swallows the previous turn
            start = max(start, int(turns[-1].start * SAMPLE_RATE) + SAMPLE_RATE // 4)
        pieces.append((start, audio))
        turns.append(RefTurn(round(start / SAMPLE_RATE, 3),
                             round((start + len(audio)) / SAMPLE_RATE, 3),
                             f"S{line.speaker}", line.text))
        previous_end = max(previous_end, start + len(audio))
    return Conversation(item, path, turns, write_mix(path, pieces))


def build(directory: Path, indices: range | list[int] | None = None,
          seed: int = SEED, variants: tuple[str, ...] = VARIANTS) -> list[Conversation]:
    """Render conversations `indices` (default: the whole set) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    return [render(spec(i, seed, variants), directory / f"conversation-{seed}-{i:02d}.wav")
            for i in (range(COUNT) if indices is None else indices)]


def build_monologues(directory: Path, indices: range | list[int], seed: int = SEED,
                     lines: int | None = None,
                     variants: tuple[str, ...] = VARIANTS) -> list[Conversation]:
    """Render monologues `indices` into `directory` (`lines`: `lengthened` to so many)."""
    directory.mkdir(parents=True, exist_ok=True)
    return [render(monologue(i, seed, variants) if lines is None
                   else lengthened(monologue(i, seed, variants), lines, seed),
                   directory / f"monologue-{seed}-{i:02d}-{lines or 0}.wav") for i in indices]


def build_long(directory: Path, indices: range | list[int], lines: int,
               seed: int = SEED, variants: tuple[str, ...] = VARIANTS) -> list[Conversation]:
    """Render conversations `indices`, `lengthened` to `lines` lines, into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    return [render(lengthened(spec(i, seed, variants), lines, seed),
                   directory / f"long-{seed}-{i:02d}-{lines}.wav") for i in indices]
