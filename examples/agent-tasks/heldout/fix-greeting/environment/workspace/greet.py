print('good night')
