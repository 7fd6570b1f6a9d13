"""The texts spoken in the long-form fixtures (`scripts/make_longform_fixtures.py`).

Every sentence here was written for this project and is dedicated to the public domain (CC0). They avoid words that
English spells two ways (British and American), digits and rare names, so that a reference word and Whisper's
spelling of it agree after the English normaliser and a word error is a real one.
"""

from __future__ import annotations

# (a) dense speech, many voices, packed into full 30 s windows: short and medium sentences
DENSE = [
    "The little port was quiet when the first boats came back from the sea.",
    "Gulls followed them in, crying over the nets and the wet ropes.",
    "On the pier an old woman was selling bread from a wooden cart.",
    "Her grandson counted the coins and kept them in a tin box.",
    "The baker lit his ovens long before the sun rose over the cliffs.",
    "The smell of warm loaves drifted down the hill to the water.",
    "Fishermen stopped at his door on their way home.",
    "Some of them bought small cakes for their children.",
    "The lighthouse stood on a rock at the far end of the bay.",
    "Its keeper climbed the narrow stairs twice a day to clean the lamp.",
    "He had lived alone out there for many years.",
    "During the winter storms he wrote long letters to his sister in the city.",
    "She answered with parcels of books, tea and thick warm socks.",
    "One spring a young teacher arrived on the morning ferry.",
    "She carried a single suitcase and a bag full of maps.",
    "The children of the town had never had a school of their own.",
    "They had walked to the next village, an hour along the cliffs.",
    "The teacher rented two rooms above the bakery.",
    "In the larger room she set up benches and a blackboard.",
    "On the first day only five pupils came through the door.",
    "By the end of the week there were more than twenty.",
    "The baker complained about the noise, but he smiled when he said it.",
    "In the afternoons the class walked down to the beach.",
    "They learned the names of the shells, the birds and the stars.",
    "The keeper of the lighthouse invited them to see the great lamp.",
    "He showed them how the lens turned and how the light was measured.",
    "A boy named Peter asked whether the keeper was ever afraid.",
    "The old man thought for a while before he answered.",
    "Only of the fog, he said, because the fog hides everything.",
    "That summer the fog came early and stayed for days.",
    "The boats could not leave, and the town grew restless.",
    "People sat in the tavern and told stories of older storms.",
    "On the fourth night a bell was heard far out in the bay.",
    "It was a small boat that had lost its way in the mist.",
    "The keeper lit every lamp he had and sounded the horn.",
    "The children ran along the shore with lanterns in their hands.",
    "At last the boat found the stone wall of the pier and came safely in.",
    "Inside were a tired fisherman and his two frightened sons.",
    "The baker brought them hot soup and a basket of bread.",
    "The next morning the fog lifted as suddenly as it had come.",
    "The teacher wrote the whole story on her blackboard.",
    "Her pupils copied it carefully into their new notebooks.",
    "Years later some of them still kept those pages.",
    "And the keeper told the story to every visitor who climbed his stairs.",
    "The ferry still comes twice a week, loaded with letters and flour.",
    "Nobody in the town has been lost in the fog since that night.",
]

# (b) a dialogue of two speakers, alternating (speaker A says the even lines, B the odd ones)
DIALOGUE = [
    "Did you remember to bring the keys to the shed?",
    "I left them on the kitchen table, next to the radio.",
    "Then we will have to walk back up the hill.",
    "It is not far, and the evening is warm.",
    "Last time we went back, the gate was locked behind us.",
    "That was because the farmer thought we were thieves.",
    "He still looks at me strangely when I buy his eggs.",
    "You did climb over his fence in the dark.",
    "Only because the path was flooded after the rain.",
    "Let us take the road this time and not the field.",
    "Fine, but you will carry the lamp.",
    "Why is it always me who carries the lamp?",
    "Because you are the one who knows the way.",
    "I know the way because you always get lost.",
    "I do not get lost, I simply explore.",
    "Is that what you called it when we ended up at the lake?",
    "The lake was beautiful that night, you have to admit it.",
    "It was beautiful, and it was also very cold.",
    "Here is the gate, and look, it is open.",
    "The keys are exactly where I said they would be.",
    "Good, then take them and let us go home before it rains.",
    "It is already starting, I felt a drop on my hand.",
    "Then we should run, the shed can wait until tomorrow.",
    "Tomorrow you will say the same thing again.",
    "Perhaps, but tomorrow I will bring the keys myself.",
    "I will believe that when I see it.",
]

# (c) a memoir whose last sentence is cut: only LAST_SPOKEN of LAST_SENTENCE is in the audio
GARDEN = [
    "My grandfather kept a garden behind the house where I grew up.",
    "It was not large, but every corner of it had a purpose.",
    "Beans climbed the fence along the eastern side.",
    "Potatoes grew in long rows beside the shed.",
    "Near the kitchen door there was a bed of herbs for cooking.",
    "He knew the name of every plant and the month it liked best.",
    "In the early spring he turned the soil with an old fork.",
    "I followed him with a bucket and picked out the stones.",
    "He paid me one sweet for every ten stones I found.",
    "By the end of the morning my pockets were full of sweets.",
    "The people next door often leaned over the wall to ask his advice.",
    "He gave it freely, along with seeds wrapped in paper.",
    "On rainy days he sat by the stove and read about seeds.",
    "He marked the pages with strips of newspaper.",
    "When the summer came the garden was almost too green to walk through.",
    "We ate salad at every meal and still could not keep up.",
    "My mother made jam from the berries and gave jars away to anyone who passed.",
    "In the autumn the apple tree dropped its fruit on the roof of the shed.",
    "The sound woke me at night, like someone knocking softly.",
    "Grandfather stored the apples in boxes in the cellar.",
    "They lasted until the middle of the winter if we were careful.",
    "Some years the slugs ate half of the lettuce before we noticed.",
    "Grandfather fought them with ashes from the stove and a great deal of patience.",
    "Once a hedgehog moved in under the shed and solved the problem for us.",
    "We left a saucer of water out for it every evening.",
    "In dry summers we carried water from the well in heavy cans.",
    "The plants seemed to know, and they stood up straighter after every can.",
    "When he grew older he could no longer bend to the ground.",
    "So we built raised beds out of planks from the old barn.",
    "He sat on a stool between them and worked with his hands.",
    "He said that a garden teaches patience better than any book.",
    "I did not understand that until I had a garden of my own.",
    "Now I turn the soil every spring with the same old fork.",
    "My daughter follows me with a bucket and picks out the stones.",
    "I pay her one sweet for every ten stones she finds.",
]
LAST_SENTENCE = ("Last week she asked me who had taught me all of this, and I told her about the old man and the "
                 "garden behind the house.")
LAST_SPOKEN = "Last week she asked me who had taught me all of this"  # the audio is cut at the comma's pause

# (d) one speaker, speed varied per sentence, a few long sentences
BRIDGES = [
    "Good evening, and thank you all for coming out on such a cold night.",
    "Tonight I want to talk about bridges, and about the people who built them long before there were engines "
    "or steel.",
    "For most of history, crossing a river was slow, expensive and often dangerous.",
    "A person on a journey had to wait for a ferry, pay whatever the ferryman asked, and hope that the current "
    "was kind.",
    "The first bridges were simple things.",
    "A fallen tree across a stream is a bridge, and so is a line of flat stones laid in shallow water.",
    "Later, builders learned to shape the stone into arches, which carry their weight outward and down into the "
    "banks.",
    "An arch is a clever idea, because every stone presses against the next one and the whole curve holds "
    "itself up.",
    "Some of those old stone bridges are still in use today, after many centuries of carts, horses, floods and "
    "frost.",
    "Wooden bridges were quicker to build, but they did not last.",
    "Fire, rot and high water destroyed them again and again.",
    "When iron became cheap, everything changed.",
    "Engineers could now span wide valleys and deep gorges that no arch of stone could ever reach, and the "
    "railways carried their trains across them at speeds nobody had imagined.",
    "Not every experiment was a success.",
    "Some bridges swayed in the wind, and a few of them fell, sometimes with terrible loss of life.",
    "Each failure taught a lesson, and the lessons were written into the rules that builders still follow.",
    "Now we build with concrete and cables, and the longest bridges hang from towers taller than any church.",
    "Stone, wood and iron each had their age, and each age left its bridges behind for us to study.",
    "Today we hardly notice the bridges we cross on the way to work.",
    "We drive over them in a few seconds and think about something else entirely.",
    "But the next time you cross a river, I would ask you to look down for a moment at the water and up at the "
    "structure that carries you, and to remember the long line of patient people who learned, one mistake at a "
    "time, how to make it safe.",
    "In the end, a bridge is a promise that the other side can be reached.",
    "That is really all I wanted to say.",
    "Thank you for listening, and please help yourselves to tea and biscuits at the back of the hall.",
]

# short clips whose first word is a weak syllable
WEAK_ONSETS = [
    "A narrow path ran between the houses down to the river.",
    "The old clock in the hall had stopped at midnight.",
    "In the morning the whole valley was covered in snow.",
    "An empty boat drifted slowly past the landing.",
    "Of all the rooms in the house, the library was the coldest.",
    "At the end of the road there was a small green gate.",
    "As soon as the rain stopped, the birds began to sing.",
    "To reach the farm you have to cross two fields.",
]
