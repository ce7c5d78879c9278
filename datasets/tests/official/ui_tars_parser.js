// Runs the official UI-TARS action parser (`@ui-tars/action-parser`, found through NODE_PATH) on the
// answers given as a JSON list on stdin; prints its `parsed` lists as a JSON list. Factor 1 and no
// screen: points come back as written, divided by 1.
const { actionParser } = require('@ui-tars/action-parser');
let input = '';
process.stdin.on('data', (d) => (input += d));
process.stdin.on('end', () => {
  const out = JSON.parse(input).map((prediction) => actionParser({ prediction, factor: [1, 1] }).parsed);
  process.stdout.write(JSON.stringify(out));
});
