"""Distinct paragraphs of ordinary English prose must never be reported as a text loop."""

from __future__ import annotations

import pytest

from pipeline.contract import build_suite
from pipeline.contract.models import ContractInput
from pipeline.text import simhash
from tests.support import require_fastscan

PROSE = [
    "The harbour was quiet in the early morning, and the only sound came from the gulls "
    "that circled above the fishing boats while their crews sorted nets on the wet stones "
    "of the quay.",
    "Most of the committee agreed that the budget needed revision, but nobody could say "
    "which programme should give up its share first without upsetting the voters who had "
    "campaigned for it.",
    "She opened the old ledger carefully, because its spine had cracked decades ago, and "
    "found a list of names written in faded brown ink beside the prices of flour, salt and "
    "lamp oil.",
    "Photosynthesis converts light energy into chemical energy stored in sugars, a process "
    "that depends on chlorophyll, water drawn up through the roots and carbon dioxide taken"
    " from the air.",
    "When the train stopped unexpectedly between two stations, the passengers looked up "
    "from their phones and newspapers, waiting for an announcement that took nearly ten "
    "minutes to arrive.",
    "A good sourdough starter needs regular feeding with flour and water, a warm kitchen, "
    "and enough patience to let the wild yeasts and bacteria build a sour, lively culture "
    "over a week.",
    "The museum's new wing displays tools from the bronze age, including axes, sickles and "
    "a small bronze mirror that archaeologists recovered from a burial mound near the river"
    " crossing.",
    "Interest rates rose three times during the year, which cooled the housing market, "
    "slowed consumer borrowing and made several large infrastructure projects far more "
    "expensive to finance.",
    "He learned to sail on a small dinghy at the lake, capsizing more often than not, until"
    " an old instructor taught him to read the wind by watching ripples move across the "
    "surface of the water.",
    "The software team adopted code review for every change, which slowed them down for a "
    "month but soon reduced the number of defects that reached customers and made new "
    "colleagues productive faster.",
    "Volcanic soils are often remarkably fertile because the ash weathers into minerals "
    "rich in potassium and phosphorus, which is why vineyards and orchards cluster on the "
    "slopes of dormant peaks.",
    "Our grandmother kept chickens behind the cottage and insisted that eggs tasted better "
    "when the hens had grass, sunshine and a few kitchen scraps, a claim none of us ever "
    "dared to dispute.",
    "The orchestra rehearsed the symphony for six weeks, spending most of that time on the "
    "slow movement, where the strings must sustain long quiet phrases without losing "
    "tension or pitch.",
    "Migrating birds navigate using a combination of cues, among them the position of the "
    "sun, patterns of stars, the earth's magnetic field and landmarks such as coastlines "
    "and mountain ranges.",
    "After the flood, volunteers cleared mud from the library basement, dried thousands of "
    "books in rented warehouses and rebuilt the catalogue by hand over the course of a "
    "long, wet winter.",
    "A well designed survey asks one question at a time, avoids leading wording, offers "
    "balanced answer options and is tested on a small group before it is sent to thousands "
    "of respondents.",
    "The mountain path climbed through pine forest, crossed a stream on slippery stepping "
    "stones and finally opened onto a meadow where cattle grazed beneath a ridge still "
    "streaked with snow.",
    "Electric buses have lower running costs than diesel ones, yet cities must plan depot "
    "charging, grid connections and battery replacement before the savings appear in their "
    "annual accounts.",
    "The detective noticed that the clock on the mantelpiece had stopped at twenty past "
    "four, exactly the hour when the housekeeper claimed to have heard a carriage leaving "
    "the drive in a hurry.",
    "Children learn languages with surprising ease when they hear them spoken daily, "
    "whereas adults usually need structured lessons, deliberate practice and many "
    "embarrassing conversations.",
    "Coral reefs cover a tiny fraction of the ocean floor but shelter about a quarter of "
    "marine species, which makes their bleaching in warmer seas a serious concern for "
    "fisheries everywhere.",
    "The bakery on the corner opens at six, and by half past the queue stretches past the "
    "pharmacy, full of builders, nurses ending night shifts and students who have not yet "
    "gone to bed.",
    "In medieval towns the guilds controlled who could practise a trade, set standards for "
    "quality and prices, and looked after members who fell ill or widows who were left "
    "without support.",
    "Good documentation explains why a design was chosen, not only how to use it, so that "
    "future maintainers can judge whether the original constraints still hold before they "
    "change anything.",
    "The comet will be visible to the naked eye for about two weeks in March, low on the "
    "western horizon shortly after sunset, provided the sky is clear and away from bright "
    "city lights.",
    "Tea arrived in Europe in the seventeenth century as an expensive luxury, and within "
    "two hundred years it had become an ordinary drink served in working households across "
    "the whole continent.",
    "The referee waved play on after the collision, and the crowd howled in protest, but "
    "replays later showed that the defender had touched the ball cleanly before the striker"
    " fell over.",
    "Glaciers carve valleys into a characteristic U shape, leaving behind polished rock, "
    "scattered boulders and long ridges of gravel that record how far the ice advanced "
    "during the last cold period.",
    "Our neighbours spent the summer restoring a narrow canal boat, replacing rotten "
    "planks, painting roses on the cabin doors and learning how to steer it through locks "
    "without scraping the walls.",
    "A compiler translates source code into machine instructions in several stages, parsing"
    " the text into a tree, checking types, optimising the intermediate form and finally "
    "emitting code.",
]


def test_fixture_is_thirty_long_distinct_paragraphs() -> None:
    """The fixture itself: 30 paragraphs, each at least 20 words, none repeated."""
    assert len(PROSE) == 30
    assert len(set(PROSE)) == 30
    assert all(len(p.split()) >= 20 for p in PROSE)


@pytest.mark.parametrize("engine", ["python", "c"])
def test_distinct_prose_is_not_a_loop(engine: str) -> None:
    """Thirty distinct real-prose paragraphs in one document raise no text-loop failure."""
    if engine == "c":
        require_fastscan()
    suite = build_suite(engine=engine)
    report = suite.run([ContractInput(text="\n\n".join(PROSE), claimed_format="markdown")])
    assert [f for f in report.failures if f.check == "no_text_loop"] == []


def test_distinct_prose_fingerprints_are_far_apart() -> None:
    """Word 3-gram fingerprints of distinct paragraphs stay well above Hamming distance 9."""
    fps = [simhash.fingerprint(p) for p in PROSE]
    closest = min(
        simhash.hamming(fps[i], fps[j]) for i in range(len(fps)) for j in range(i + 1, len(fps))
    )
    assert closest > simhash.TEXT_LOOP_MAX_DISTANCE
